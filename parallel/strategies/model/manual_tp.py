"""manual_tp: Megatron tensor parallelism by hand (Shoeybi et al. 2019): the layers themselves split over the ranks.

    torchrun --nproc_per_node=2 scripts/manual_tp.py --workload mlp|transformer

Every rank trains on the whole batch; what it holds is its part of each split layer, as the model's
TPPlan says (workloads.py), and all of every other layer:

    colwise Linear   rows r/N of W and b: rank r computes its 1/N of the output's features
    rowwise Linear   columns r/N of W: rank r computes a partial sum x_r W_r^T; g sums the partial
                     sums over the ranks, then the bias is added, once
    region input     f copies it to the split layers: identity forward; backward, each rank holds only
                     its part of the input's gradient, and f sums them

    MLP     f -> layers.0 (colwise) -> relu -> layers.2 (rowwise) -> g -> relu -> f -> layers.4 -> relu
            -> layers.6 -> g -> relu -> layers.8 (replicated)
    block   x + g(proj(attention(q, k, v of f(norm1 x))))   q, k, v colwise: each rank attends with
            x + g(mlp.2(gelu(mlp.0(f(norm2 x)))))            its H/N heads (q, k, v split alike)

f and g are conjugate, each one all-reduce of the activations (B x T x C) in one direction: a
colwise/rowwise pair costs one forward and one backward, 4 all-reduces per transformer block per step.
The replicated layers (embeddings, norms, the head) see the same inputs and the same output gradients
on every rank (g and f make them so), so they get the same gradient everywhere and need no all-reduce
of their own. Each rank holds 1/N of the split layers' parameters, gradients and optimizer state.

Grouped-query attention with fewer kv heads than ranks (Llama 3 8B's 8 at tp 16): each kv head is
copied to the N / kv ranks whose query heads read it, and those ranks add their shares of its gradient
before the step (kit/kv_copies.py: the one collective here outside f and g).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td
import torch.nn.functional as F
from torch import nn

from parallel.kit import collectives, kv_copies
from parallel.loop import checkpoint, muon, optim
from parallel.measure import layers
from parallel.models.outputs import call
from parallel.models.transformer import Attention
from parallel.models.workloads import summed_params, tp_plan_of
from parallel.strategies.base import Hooks, Mutant, Trainable, injected, loaded_in_place, model_state_every_rank
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "manual_tp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    copies = kv_copies.copied(model, dist.world_size, dist.rank)  # fewer kv heads than ranks: each head m times
    summed = summed_params(model)  # whole weights on this rank's heads (TPPlan), found before the split
    with optim.kept(model):  # every rank built the model from the seed: each keeps its part (kinds by name)
        colwise, rowwise = shard(model, dist.rank, dist.world_size, run)
    model = model.to(dist.device)
    collectives.sum_as_made(summed)
    if injected(run, RANK_BRANCH) and dist.rank == 1:  # the bug: a rank-dependent branch in the model
        model.head[0].register_forward_hook(lambda module, args, out: F.dropout(out, 0.1, training=True))
    split = {f"{n}.weight" for n in colwise + rowwise} | {f"{n}.bias" for n in colwise}  # a row split's bias is whole
    whole = tuple(range(dist.world_size))  # the rest every rank holds alike (--check-replicas)
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device,
                     state=Split(dist.world_size, colwise, rowwise, copies),
                     held_by={k: whole for k, _ in model.named_parameters() if k not in split}
                     | kv_copies.held_by(copies))


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # the whole batch, on every rank
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()
    if not injected(t, KV_UNSUMMED):
        kv_copies.sum_copies(t.model, t.state.copies)  # a kv head's copies: their ranks' shares of its gradient
    t.optimizer.step()  # each rank its part of the split layers, and all of the replicated ones
    return loss.detach()


class _Copy(torch.autograd.Function):
    """f: identity forward; backward, the input's gradient summed over the ranks (each holds a part)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        td.all_reduce(grad)
        return grad


class _Sum(torch.autograd.Function):
    """g: the ranks' partial outputs summed forward; backward, identity (every rank needs it whole)."""

    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        td.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class ColumnLinear(nn.Module):
    """This rank's rows of a Linear's weight and bias: its part of the output's features."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, copy_input: bool):
        super().__init__()
        self.weight = muon.split(nn.Parameter(weight.clone()), 0)  # Muon gathers its rows (loop/muon.py)
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        self.copy_input = copy_input  # outside a region: its own f

    def forward(self, x):
        return F.linear(_Copy.apply(x) if self.copy_input else x, self.weight, self.bias)


class RowLinear(nn.Module):
    """This rank's columns of a Linear's weight, and the whole bias: its partial output, summed by g."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bias_every_rank: bool = False):
        super().__init__()
        self.weight = muon.split(nn.Parameter(weight.clone()), 1)  # and its columns
        self.bias = None if bias is None else nn.Parameter(bias.clone())
        self.bias_every_rank = bias_every_rank  # the manual_tp:bias-every-rank bug

    def forward(self, x):
        if self.bias_every_rank:
            return _Sum.apply(F.linear(x, self.weight, self.bias))
        y = _Sum.apply(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


@dataclass
class Split:
    """What the strategy keeps: which modules are split how, for the state dict and checkpoints."""

    world: int
    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    copies: kv_copies.Copies | None = None  # kv heads fewer than the ranks: each copied to the ranks reading it


def _rows(t: torch.Tensor | None, rank: int, n: int, dim: int = 0) -> torch.Tensor | None:
    return None if t is None else t.detach().chunk(n, dim=dim)[rank]  # None: a Linear without bias


def shard(model: nn.Module, rank: int, n: int, run) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Replace every split Linear of the model's plan by this rank's part of it; f on every region."""
    plan = tp_plan_of(model)
    in_region = {c for c in plan.colwise for r in plan.regions if c.startswith(r + ".")}
    full = {name: model.get_submodule(name) for name in plan.colwise + plan.rowwise}  # before any is replaced
    parts = {}
    for name in plan.colwise:
        weight, bias = _rows(full[name].weight, rank, n), _rows(full[name].bias, rank, n)
        parent, _, attr = name.rpartition(".")
        if injected(run, FUSED_QKV_SPLIT) and attr in ("q", "k", "v"):  # the bug: [q | k | v] cut in N pieces
            stacked = [torch.cat([full[f"{parent}.{a}"].weight, full[f"{parent}.{a}"].bias[:, None]], dim=1)
                       for a in "qkv"]
            piece = _rows(_rows(torch.cat(stacked), rank, n), "qkv".index(attr), 3)
            weight, bias = piece[:, :-1], piece[:, -1]
        parts[name] = ColumnLinear(weight, bias, copy_input=name not in in_region)
    for name in plan.rowwise:
        parts[name] = RowLinear(_rows(full[name].weight, rank, n, dim=1), full[name].bias,
                                injected(run, BIAS_ON_EVERY_RANK))
    for name, part in parts.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, part)
    for name in plan.regions:
        model.get_submodule(name).register_forward_pre_hook(_copy_first_input, with_kwargs=True)
        if injected(run, MASK_DROPPED):  # the bug: the region's wrapper passes its input on, nothing else
            model.get_submodule(name).register_forward_pre_hook(lambda m, args, kwargs: (args[:1], {}),
                                                                with_kwargs=True)
    return plan.colwise, plan.rowwise


def with_first_input(args: tuple, kwargs: dict, fn) -> tuple[tuple, dict]:
    """A region's input made fn(input), as a forward pre-hook (with_kwargs) returns it: its first positional
    argument, or (Hugging Face calls attention with keyword arguments only) its first tensor keyword
    argument. manual_tp's f and tensor_parallel's region style both take it from here."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
    if key is None:
        raise TypeError("a region's forward was called without a tensor argument: it has no input to copy (f)")
    return args, {**kwargs, key: fn(kwargs[key])}


def _copy_first_input(module, args, kwargs):
    """f on a region's input (with_first_input)."""
    return with_first_input(args, kwargs, _Copy.apply)


def plan_problems(model: nn.Module, tp: int, copies: bool = True, muon: bool = False) -> str | None:
    """Why `model` cannot be split over `tp` ranks (a size that does not divide), or None. `copies`: kv heads
    fewer than tp are copied to their readers (kit/kv_copies.py), summed weights summed; fsdp_tp does neither."""
    for name, m in model.named_modules():
        if isinstance(m, Attention) and (heads := m.q.out_features // m.head_size) % tp:
            return f"tp {tp} does not divide {name}'s {heads} heads"
        if isinstance(m, Attention) and (kv := m.k.out_features // m.head_size) % tp and (kv > tp or not copies):
            return (f"tp {tp} does not divide {name}'s {kv} kv heads (grouped-query attention; fewer kv heads "
                    "than ranks are copied to the ranks that read them, by manual_tp and tensor_parallel)")
    if why := kv_copies.problem(model, tp, muon):
        return why
    plan, copied = tp_plan_of(model), {f"{n}.{p}" for n, _, _ in kv_copies.kv_heads_below(model, tp) for p in "kv"}
    if plan.summed and not copies:
        return f"its plan sums {plan.summed[0]}'s gradient over the ranks: tensor_parallel and manual_tp do, not this"
    for name in plan.colwise + plan.rowwise:
        if type(layer := model.get_submodule(name)) is not nn.Linear:  # GPT-2's Conv1D holds its weight transposed
            return f"its plan names {name}, a {type(layer).__name__}: the plan splits nn.Linear layers only"
    for name in (c for c in plan.colwise if c not in copied):  # a copied k or v: tp copies of one head's rows
        if (out := model.get_submodule(name).out_features) % tp:
            return f"tp {tp} does not divide {name}'s {out} output features"
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        if (size := getattr(parent, "head_dim", None)) and (heads := out // size) % tp:  # whole heads a rank:
            return f"tp {tp} does not divide {name}'s {heads} heads"  # grouped-query k/v have fewer
    for name in plan.rowwise:
        if (inp := model.get_submodule(name).in_features) % tp:
            return f"tp {tp} does not divide {name}'s {inp} input features"
    return None


def check(run) -> None:
    model = run.meta_model
    if why := plan_problems(model, run.world_size, muon=run.config.optimizer == "muon"):
        raise ConfigError(f"cannot split the {run.config.workload} over {run.world_size} ranks: {why}")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
FUSED_QKV_SPLIT = Mutant("manual_tp:fused-qkv-split", "q, k and v split as one fused [q | k | v] matrix cut into N "
                         "contiguous pieces, not by heads: rank 0 gets all of q's heads and half of k's "
                         "(pytorch#140069)", {"workload": "transformer"})
BIAS_ON_EVERY_RANK = Mutant("manual_tp:bias-every-rank", "a rowwise layer's bias added before the all-reduce, on "
                            "every rank: N times the bias", {"workload": "mlp"})
RANK_BRANCH = Mutant("manual_tp:rank-branch", "the model's forward branches on the rank: a debugging branch left "
                     "in (`if rank == 1`) drops out part of the final norm's output on rank 1 only, so the "
                     "replicated head sees different inputs on the two ranks", {"workload": "transformer",
                                                                                "check_replicas": True},
                     shows="replicas")
KV_UNSUMMED = Mutant("manual_tp:kv-copies-unsummed", "fewer kv heads than ranks (multi-query attention at tp 2): "
                     "each rank's copy of its kv head steps with its own query heads' share of the gradient, "
                     "never summed with the other copies'", {"workload": "transformer", "arch": "llama",
                                                             "kv_heads": 1})
MASK_DROPPED = Mutant("manual_tp:document-mask-dropped", "packed sequences: the attention region's wrapper passes "
                      "its input on and drops the rest, so attention crosses documents and positions do not "
                      "restart (docs/loss.md)", {"workload": "transformer", "tokens": "packed"})
MUTANTS = (FUSED_QKV_SPLIT, BIAS_ON_EVERY_RANK, RANK_BRANCH, KV_UNSUMMED, MASK_DROPPED)


def dims(run, dist) -> ParallelDims:
    """One tensor-parallel group: every rank the whole batch; one loss counts (they are all the same)."""
    return ParallelDims(world=dist.world_size, tp=dist.world_size)


def _gathered(t: torch.Tensor, dim: int, world: int) -> torch.Tensor:
    """The whole tensor from every rank's part of it, joined along `dim` (a collective)."""
    parts = [torch.empty_like(t) for _ in range(world)]
    td.all_gather(parts, t.detach().contiguous())
    return torch.cat(parts, dim=dim)


def _split_dim(s: Split, name: str) -> int | None:
    """The dim of a state-dict entry split across the ranks: colwise weights and biases 0, rowwise weights 1;
    None for what every rank holds whole (rowwise biases, the replicated layers)."""
    module, _, kind = name.rpartition(".")
    if module in s.colwise:
        return 0
    if module in s.rowwise and kind == "weight":
        return 1
    return None


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """The whole model under its own names: every split weight gathered from the ranks (a collective)."""
    out = {}
    for name, value in t.model.state_dict().items():
        dim = _split_dim(t.state, name)
        whole = value if dim is None else _gathered(value, dim, t.state.world)
        out[name] = whole.detach().cpu().clone()
    return kv_copies.one_copy(out, t.state.copies)


def checkpoint_state(t: Trainable) -> dict:
    """The live state, each split tensor under a key of this rank's own (checkpoint.per_rank)."""
    return checkpoint.per_rank(t, lambda name: _split_dim(t.state, name) is not None, t.state.world)


TENSOR_PARALLEL = True  # trains only workloads whose model has a tp_plan()
LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)

MEASURE = layers.Megatron()  # the collectives per block, Megatron's bytes and step (parallel/measure/layers.py)

HOOKS = Hooks(dims=dims, check=check, state_dict=state_dict, model_state_bytes=model_state_every_rank,
              checkpoint_state=checkpoint_state, restore_checkpoint=loaded_in_place)
