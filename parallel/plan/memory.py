"""Memory per GPU by kind: model state by ZeRO stage (formulas.model_state), activations by
activations.formula (what each run's LayerMeter checks to the byte) times the micro-batches a stage holds,
and the buffers."""

from __future__ import annotations

from parallel import activations
from parallel.formulas import model_state
from parallel.plan.hardware import GiB
from parallel.plan.layouts import ELEM, OPTIMIZERS, Layout, Training, micro_batches
from parallel.plan.models import ModelSpec


def params_per_gpu(model: ModelSpec, lay: Layout, stage: str = "first") -> tuple[float, float]:
    """(dense, expert) parameters on a GPU of the `stage` ("first" or "last") before any ZeRO sharding: its
    layers, split by tp (experts by tp x ep); the first stage adds the token (and position) embedding, the
    last the head (a tied head's copy too, as Megatron keeps one there) and the final norm; pp = 1 both."""
    layers = lay.layers(model.layers)
    experts = model.expert_params * model.experts * layers / (lay.tp * lay.ep) if model.experts else 0.0
    dense = (model.layer_params - (model.expert_params * model.experts if model.experts else 0)) * layers / lay.tp
    positions = model.seq * model.hidden if model.arch == "gpt" else 0
    head = model.vocab * (model.hidden + (model.arch == "gpt" and not model.head_tied)) + model.norm_params // 2
    ends = {"first": model.vocab * model.hidden + positions, "last": head}
    extra = sum(ends.values()) - (model.vocab * model.hidden if model.head_tied else 0) if lay.pp == 1 \
        else ends[stage]  # one GPU, a tied head is the embedding itself
    return dense + extra / lay.tp, experts


def state_of(model: ModelSpec, lay: Layout, train: Training, stage: str = "first") -> dict[str, float]:
    """Model state bytes by kind: dense parameters sharded (by the ZeRO stage) over dp x cp, expert
    parameters over the dp x cp / ep ranks that hold copies of the same experts."""
    dense, experts = params_per_gpu(model, lay, stage)
    shards, expert_shards = lay.shards()
    state = OPTIMIZERS[train.optimizer][1]
    if state is not None:  # SGD over fp32 weights (compare's): fp32 gradients, its buffer
        sizes = (4, 4, state)
    elif train.precision == "fp32":
        sizes = (4, 4, train.optimizer_bytes - 4)
    else:
        sizes = (ELEM[train.precision], train.grad_bytes, train.optimizer_bytes)
    state = model_state(dense, lay.zero_stage, shards, *sizes)
    if experts:
        for k, v in model_state(experts, lay.zero_stage, expert_shards, *sizes).items():
            state[k] += v
    return state


def in_flight(lay: Layout, m: int) -> float:
    """Micro-batches' worth of L/pp layers the first stage holds at its peak: GPipe all m; 1F1B p
    (Narayanan 2021); interleaved, p (1 + (p-1)/(p v)) (Korthikanti 2022, section 4.2.3)."""
    p, v = lay.pp, lay.stages_per_rank
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return m
    return min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)


def layer_activations(model: ModelSpec, lay: Layout, train: Training) -> float:
    """activations.formula for one layer and micro-batch on one GPU (context parallel: s/cp positions)."""
    terms = activations.formula(model.seq // lay.cp, lay.mbs, model.hidden, model.heads, lay.tp,
                                lay.sequence_parallel, "math" if train.attention == "unfused" else "fused",
                                lay.recompute, ELEM[train.precision], train.dropout, model.kv / model.heads,
                                model.F / model.hidden * (model.top_k if model.experts else 1), model.gated)
    return sum(terms.values())


def memory(model: ModelSpec, lay: Layout, train: Training) -> dict[str, float]:
    """GiB per GPU by kind on the stage that needs the most: the first (the embedding, the most
    micro-batches held) or the last (the head, the logits; under 1F1B one micro-batch held, interleaved
    counted as the first's, an upper bound)."""
    elem = ELEM[train.precision]
    m = micro_batches(lay, train)
    layers = lay.layers(model.layers)
    per_layer = layer_activations(model, lay, train)
    tokens = lay.tokens(model.seq)
    common = (4 * tokens * model.hidden * elem if lay.recompute == "full" else 0)  # the layer being recomputed
    if lay.zero_stage == 3:  # the gathered parameters of the layer in use and the one prefetched
        experts = model.expert_params * model.experts * (1 - 1 / lay.ep) if model.experts else 0
        common += 2 * (model.layer_params - experts) / lay.tp * elem  # a rank gathers its own experts only
    logits = tokens * model.vocab / lay.tp * (elem + 4 + 4)  # logits, fp32 softmax and its gradient
    held_last = in_flight(lay, m) if lay.pp == 1 or lay.stages_per_rank > 1 or lay.schedule == "gpipe" else 1
    stages = []
    for stage, held, buffers in (("first", in_flight(lay, m), common + (logits if lay.pp == 1 else 0)),
                                 ("last", held_last, common + logits)):
        out = {**state_of(model, lay, train, stage), "activations": per_layer * layers * held, "buffers": buffers}
        stages.append({k: v / GiB for k, v in out.items()} | {"total": sum(out.values()) / GiB, "stage": stage})
        if lay.pp == 1:
            break
    worst = max(stages, key=lambda d: d["total"])
    return {k: v for k, v in worst.items() if k != "stage"}
