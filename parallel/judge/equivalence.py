"""The oracle: is a strategy's training the same as one device's? Every tensor and every step's loss, against `single`.

Each tensor k (every parameter and floating buffer) against its own scale, how far `single` moved it:

    err_k = max |p_k - p_k(single)|   <=   tol_k = RTOL * max(move_k, FLOOR * mag_k, TINY)
    move_k = max |p_k(single) - p_k(initial)|        mag_k = max |p_k(single)|

and each loss of each step j (both of the DCGAN's) against how far `single`'s loss had moved by then:

    |l_j - l_j(single)|   <=   RTOL * max_{i<=j} |l_i(single) - l_0(single)|  +  LOSS_FLOOR * |l_j(single)|

Integer buffers (BatchNorm's batch counter) must be equal. The verdict is "match" when every ratio
err/tol is at most 1; it names the worst tensor and the first step whose loss was off.

Why per tensor: one tolerance from the largest movement passed DDP's unsynced BatchNorm (2e-4 vs 9.1e-3).

Why 2% of the movement (RTOL): fp32 rounding differs between any two ways of summing the same numbers
(threads, ranks, shards), and over steps that noise grows with the dynamics. Measured here, the worst
tensor's difference over its movement after the default 23 steps:

    `single` on 1 vs 2 threads, seed 0:  mlp 3.1e-4  cnn 3.2e-6  transformer 1.7e-5  dcgan 7.0e-4
    `single` on 1 vs 2 threads, the DCGAN over seeds 0-2: up to 4.2e-3 (its adversarial steps amplify)
    every honest strategy, 24 runs (seeds 0-2, every workload, cpu:2 and cpu:3): up to 9.2e-3, DDP on
    the DCGAN, generator.0.weight; every other workload at most 2.7e-3

(`python -m parallel.judge.noise` re-measures the first line, `mutants --honest 3` the last). Bugs
sit above: a 5% learning-rate error is about 5e-2 of every tensor's movement, the subtlest injected bugs
0.12 (micro-batches weighted 1/m) and 0.13 (unsynchronised BatchNorm), the rest of the order of the
movement. 2% leaves a factor of 2 on the noise side and of at least 2.5 on the bugs' (1% had left DDP on
the DCGAN at 0.92 of its tolerance).

What no fp32 rule can leave a margin for: a ReLU or a max-pool whose two sides sit within rounding of each
other takes the other branch under another summation order, and one sample's gradient moves by a whole
contribution, not by a rounding error. Over 10 seeds x cpu:2/cpu:4 at the test suite's size (docs/oracle.md,
"Honest noise against injected bugs, 10 seeds"), 1,107 of 1,110 honest runs stayed under 0.11 of the rule;
a flipped ReLU put tensor parallelism on the MLP at 2.9x it (seed 9) and a flipped max-pool DDP on the
DCGAN at 0.99x; the smallest injected bug sits at 5.8x. Whether a near-tie flips depends on the CPU, so
the test suite judges its parity runs in float64 (--precision fp64, the FP64 rule below), where nothing
flips, and a user's fp32 mismatch below FLIP says how to tell a flip from a bug.

Why the floor (FLOOR of the tensor's magnitude): a tensor whose exact gradient is zero moves only by
rounding. The DCGAN's generator.0.bias (a transposed convolution's bias right before BatchNorm, which
subtracts it again) moved 9.8e-9 in 23 steps against a magnitude of 8.8e-3, and that movement is all
noise: 1 vs 2 threads differed by 8% of it, DDP by 100%. 1e-3 of the magnitude is 2e-5 of it after RTOL,
about 200 fp32 ulps.

Why the loss floor (LOSS_FLOOR of the loss): step 0 starts from the same weights, so its loss may differ
only by summation order, measured at most 2e-7 of the loss (DDP, mean of the ranks' means); one sample
missing from one rank's share of a 512-sample batch moved it by 1.3e-5. Parameters barely show that bug
(it changes them by about their noise); the loss curve does, at step 0: 2e-6 is 10x above the noise and
6x below the bug.

Why AdamW's reach: Adam normalises each element's step, m / (sqrt(v) + eps), so a tensor whose exact
gradient is zero (a causal attention's key bias: softmax ignores a shift of every key) moves by rounding
noise over eps, about lr a step: 8.8e-5 in 5 steps, ddp's 4.2e-5 off single's, 24x a rule made of that
movement, every tensor with a real gradient within 0.14 of its own. Under AdamW each tensor is also allowed
RTOL of the sum of the run's learning rates (`reach`), the most any element can move: for a tensor with a
real gradient about its own movement, so bugs stay caught (docs/optimizer.md).

Parity is a short-run property: past about 100 steps the CNN run becomes chaotic (threads alone moved
parameters 56% of their movement at 120 steps); the default 23 steps stay inside it. A loss spike shortens
it: AdamW at lr 3e-2 (norm 3.1, clipped at 1) put honest fp32 rows at 4-7x the rule in 23 steps, fp64
under 0.003 of its own (docs/measurements.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from parallel.loop.clipping import norm_name
from parallel.loop.optim import Recipe
from parallel.loop.results import Equivalence, Rule
from parallel.loop.train import default_dtype
from parallel.models.userchecks import cannot_match
from parallel.models.usermodel import workload_of

RTOL = 2e-2
FLOOR = 1e-3  # of the tensor's magnitude: a tensor that barely moves is judged against its rounding noise
TINY = 1e-7  # absolute: a tensor of zeros (fp32 eps is 1.2e-7 relative)
LOSS_FLOOR = 2e-6  # of the loss: step 0 may differ by summation order only (2e-7 measured)

FP32 = Rule(RTOL, FLOOR, LOSS_FLOOR, "fp32 rule")
# Under --precision bf16 `single` runs under the same casting, but a split batch still rounds differently:
# each rank's (or replica's, or micro-batch's) products are rounded to bf16 (8 bits of mantissa, relative
# step 2^-8) before they are summed, where one device rounds the whole batch's once. Measured here over
# 10 seeds (`mutants --honest 10 --size tests --precision bf16`, cpu:2 and cpu:4; docs/oracle.md): honest
# strategies differed from bf16 `single` by up to 14.4% of a tensor's movement (the MLP under
# tensor_parallel, 0.72 of this rule), 7.8% on the CNN (0.39), and on today's token data 5.3% on the MoE
# (0.264, manual_tp) and 0.7% on the transformer (0.035; 620 runs, 2026-11-29).
# So under bf16 only bugs of more than 20% of the movement are caught: `python -m parallel mutants` lists
# which; the fp32 run is the one to check a strategy with.
BF16 = Rule(0.2, 1e-2, 1e-3, "bf16 autocast in both, bf16 rule (20% of each tensor's movement)")
# Under AdamW or Muon in bf16 (either --precision) the split batch's rounding is normalised into whole steps:
# an element whose gradient is small against bf16's rounding steps by about lr in a direction rounding picks,
# and a tensor whose exact gradient is zero (an attention key's bias: softmax ignores a shift of every key)
# moves by rounding alone. Honest runs (2 seeds, cpu:2, the transformer at the suite's size; docs/optimizer.md):
# matrices up to 79% of their movement off one device's (manual_tp under bf16-master), the key biases 170%.
# No tensor rule can tell a bug from that: tensors are judged at 3x their movement (gross errors, a wrong
# dtype or shape), the curves at the bf16 rule's 20%, plus 2^-8 of the value from step 0 (bf16-master's
# gradients are bf16, summed in bf16: its norm 0.14% off at step 0); check a strategy in fp32 or fp64.
BF16_NORMALISED = Rule(3.0, 1e-2, 2**-8, "bf16 under a normalised optimiser: the loss within 20% of its "
                       "movement, each tensor within 3x its own (rounding moves AdamW's steps whole)", loss_rtol=0.2)
# Under --precision fp64 (model, data and buffers in float64) rounding is 2^29 times finer than fp32's and no
# ReLU or max-pool decision flips: over 1,110 honest runs (docs/oracle.md, 10 seeds x cpu:2, cpu:4) every
# strategy came to at most 4.1e-4 of this rule, 4e-10 of a tensor's movement, and every injected bug stays
# caught (the smallest at 10.8x). 1e-6 of the movement catches bugs far below what fp32's rule can see.
FP64 = Rule(1e-6, 1e-3, 1e-12, "fp64 rule (1e-6 of each tensor's movement)")
# Muon in fp32: torch's Newton-Schulz rounds updates to bf16, where another summation order tips a boundary
# element, spread by five iterations (fp64 does not: 2e-4 of FP64). 210 honest runs (docs/optimizer.md): up to
# 8.8% of a movement (the MoE's router), the transformer 3.0%; fsdp:muon-shard-alone 72% (6x this rule).
MUON = Rule(0.12, FLOOR, LOSS_FLOOR, "Muon's bf16 Newton-Schulz in both, its rule (12% of each tensor's movement)")
# In fp32 one ReLU or max-pool decision flipped by rounding (two sides within an ulp) moves a whole sample's
# gradient: honest runs reached 2.9x the fp32 rule that way (docs/oracle.md), the smallest injected bug
# 5.8x. A mismatch below FLIP says how to tell the two apart.
FLIP = 10.0  # (under Muon, a bf16 rounding tipped in Newton-Schulz is a flip of the same kind)
FLIP_HINT = ("rounding can flip a ReLU's or a max-pool's decision and move a tensor by a few times the fp32 rule: "
             "rerun with --precision fp64, where a bug stays a mismatch and a flip is gone")


def rule_for(strategy, config) -> Rule:
    """The rule `strategy` under `config` is judged by: its own where it casts (its `tolerance` hook), else
    bf16's under bf16 autocast (`single` too), fp64's in float64, else fp32's (Muon's own under Muon)."""
    fp32 = MUON if getattr(config, "optimizer", "") == "muon" else FP32
    bf16 = BF16_NORMALISED if getattr(config, "optimizer", "") in ("adamw", "muon") else BF16
    return strategy.tolerance(config) or {"bf16": bf16, "bf16-master": bf16, "fp64": FP64}.get(config.precision, fp32)


@dataclass
class Reference:
    """`single`'s run: where training started, where it ended, and its loss curves."""

    initial: dict[str, torch.Tensor]
    state: dict[str, torch.Tensor]
    losses: dict[str, list[float]]  # {"loss": [...]} or the DCGAN's {"d_loss": [...], "g_loss": [...]}
    noise: Rule | None = None  # a user's model that amplifies rounding: the rule its own noise allows (noise.own_noise)
    causes: dict = dataclasses.field(default_factory=dict)  # userchecks.cannot_match: what no strategy can match

    @functools.cached_property
    def scales(self) -> dict[str, tuple[float, float]]:
        """Each floating tensor's (largest move from its initial value, largest magnitude), in float64:
        computed once for every row (at GPT-2 small's 92M parameters, 1.5 s a row when each row did it)."""
        return {k: ((a.double() - self.initial[k].double()).abs().max().item(), a.double().abs().max().item())
                for k, a in self.state.items() if a.is_floating_point()}


def reference_of(config, row, state: dict[str, torch.Tensor]) -> Reference:
    """`single`'s row and final state under `config`, with the initial weights of its workload and seed,
    and what in the model no strategy can match (dropout, BatchNorm)."""
    with default_dtype(config):  # the weights the run started from: float64 ones under --precision fp64
        model = workload_of(config).build_model(config.seed)
    return Reference(model.state_dict(), state, curves(row), causes=cannot_match(model))


def curves(row) -> dict[str, list[float]]:
    """A row's curves by name, judged alike: every part of a several-loss step, else the one loss; and
    under --clip-norm each optimiser's global gradient norm (loop/clipping.py), every step."""
    losses = dict(row.loss_parts) if row.loss_parts else {"loss": list(row.losses)}
    return losses | {norm_name(k): list(v) for k, v in (getattr(row, "grad_norms", None) or {}).items()}


def reach(config) -> float:
    """How far AdamW can have moved any one element in the run, the sum of its steps' learning rates
    (its update, m / (sqrt(v) + eps), is normalised: about lr a step whatever the gradient, Kingma and Ba
    2.1); 0 under SGD, whose step is the gradient's own size. See ADAM below."""
    if getattr(config, "optimizer", "sgd") not in ("adamw", "muon"):  # Muon's step is normalised too
        return 0.0
    recipe = Recipe(config)
    return config.lr * sum(recipe.factor(s) for s in range(recipe.total))


def _tensor_ratios(ref: Reference, state: dict[str, torch.Tensor], rule: Rule, reach: float = 0.0) -> list[tuple]:
    """(err/tol, name, err, tol) for every tensor; raises ValueError when the names or shapes differ."""
    if ref.state.keys() != state.keys():
        missing, extra = sorted(ref.state.keys() - state.keys()), sorted(state.keys() - ref.state.keys())
        raise ValueError(f"parameter names differ: missing {missing[:3]}, unexpected {extra[:3]}")
    out = []
    for k, a in ref.state.items():
        b = state[k]
        if a.shape != b.shape:
            raise ValueError(f"{k}: shape {tuple(b.shape)} != baseline {tuple(a.shape)}")
        if a.dtype != b.dtype:  # bf16 weights where `single`'s are fp32 masters (loop/master.py): none kept
            raise ValueError(f"{k}: {str(b.dtype).removeprefix('torch.')} where the baseline's is "
                             f"{str(a.dtype).removeprefix('torch.')}")
        if not a.is_floating_point():  # a counter: equal, or infinitely off
            equal = torch.equal(a, b)
            out.append((0.0 if equal else float("inf"), k, 0.0 if equal else float("inf"), 0.0))
            continue
        err = (a - b).abs().max().item()  # in their own precision: off by an ulp of err, not of a
        move, largest = ref.scales[k]
        tol = rule.rtol * max(move, rule.floor * largest, reach, TINY)
        out.append((_over(err, tol), k, err, tol))
    return out


def _loss_ratios(ref: Reference, losses: dict[str, list[float]], rule: Rule) -> list[tuple[float, int, str, str]]:
    """(err/tol, step, loss name, what was off) for every step of every loss. A resumed run has fewer
    steps: they are the reference's last ones."""
    out = []
    for name, want in ref.losses.items():
        got = losses.get(name, [])
        shift, moved = len(got) - len(want), 0.0
        for j, w in enumerate(want):
            moved = max(moved, abs(w - want[0]))
            if 0 <= j + shift < len(got):
                g = got[j + shift]
                tol = (rule.loss_rtol or rule.rtol) * moved + rule.loss_floor * abs(w)
                out.append((_over(abs(g - w), tol), j, name, f"{g:.6g} vs {w:.6g}"))
    return out


def _over(err: float, tol: float) -> float:
    """err / tol, where NaN is infinitely off and 0 / 0 is exact."""
    if math.isnan(err):
        return math.inf
    return err / tol if tol else (0.0 if err == 0 else math.inf)


def judge(strategy, config, ref: Reference | None, row, state: dict | None) -> Equivalence:
    """The verdict on one run of `strategy` under `config` (its row and final state) against `single`'s,
    under the rule that run is judged by."""
    if not strategy.synchronous:
        return Equivalence("not-expected", reason=strategy.NOT_EXPECTED_REASON or "asynchronous")
    if why := (getattr(row, "details", None) or {}).get("not_expected"):  # decided by the run (tokens dropped)
        return Equivalence("not-expected", reason=why)
    if ref is None or state is None:
        return Equivalence("unchecked", reason="no baseline in this run" if ref is None else "no parameters")
    rule = rule_for(strategy, config)
    if ref.noise is not None and ref.noise.rtol > rule.rtol:
        rule = ref.noise
    steps = _loss_ratios(ref, curves(row), rule)
    off = [s for s in steps if s[0] > 1]
    try:
        tensors = _tensor_ratios(ref, state, rule, reach(config))
    except ValueError as e:  # infinitely off, as an unequal counter; the losses still say from which step
        return Equivalence("mismatch", reason="; ".join([str(e), *_first_off(off)]), ratio=math.inf,
                           first_step=min(s[1] for s in off) if off else None, basis=rule.basis)
    worst, name, err, tol = max(tensors)
    ratio = max([worst] + [s[0] for s in steps])
    verdict = "match" if ratio <= 1 else "mismatch"
    reason = ""
    if verdict == "mismatch":
        parts = [f"{name} off by {err:.3g} > {tol:.3g} ({worst:.3g}x its tolerance)"] if worst > 1 else []
        parts += _first_off(off)
        if rule is FP32 and ratio < FLIP:
            parts.append(FLIP_HINT)
        reason = "; ".join(parts)
    out = Equivalence(verdict, err, tol, reason, worst_tensor=name, ratio=ratio,
                      first_step=min(s[1] for s in off) if off else None, basis=rule.basis,
                      per_tensor={k: float(f"{r:.4g}") for r, k, _, _ in tensors})
    explain(out, strategy, ref.causes)
    return out


def _first_off(off: list[tuple[float, int, str, str]]) -> list[str]:
    """The first step whose loss was off, as the verdict's reason says it ([] when none was)."""
    if not off:
        return []
    r, step, loss, values = min(off, key=lambda s: s[1])
    return [f"{loss} first off at step {step}: {values} ({r:.3g}x its tolerance)"]


def explain(verdict: Equivalence, strategy, causes: dict[str, str]) -> None:
    """A mismatch on a model that carries its own cause (usermodel.cannot_match: dropout, BatchNorm, but
    not BatchNorm under a strategy that synchronises it, SYNCS_BATCHNORM: ddp) names that cause first,
    instead of leaving the difference to be read as a bug or as rounding."""
    why = [text for cause, text in causes.items() if not (cause == "batchnorm" and strategy.SYNCS_BATCHNORM)]
    if verdict.verdict == "mismatch" and why:
        verdict.reason = "; ".join(why) + f" ({verdict.reason})"


NOISE_MARGIN = 3  # a user's model is judged at this many times its own rounding noise, where that exceeds RTOL


def global_rule(ref: Reference, state: dict[str, torch.Tensor]) -> bool:
    """The rule before this one, kept to show what it missed: the largest difference anywhere against 1%
    of the largest movement anywhere (floor 1e-7), as it was. True when it says "match"; False where the
    names or shapes differ, which no rule lets pass."""
    try:
        diff = max(err for _, _, err, _ in _tensor_ratios(ref, state, FP32))
    except ValueError:
        return False
    move = max((ref.state[k].double() - ref.initial[k].double()).abs().max().item()
               for k in ref.state if ref.state[k].is_floating_point())
    return diff <= max(1e-7, 1e-2 * move)
