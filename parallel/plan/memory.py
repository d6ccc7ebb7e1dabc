"""Memory per GPU by kind: model state by ZeRO stage (formulas.model_state), activations by
activations.formula (what each run's LayerMeter checks to the byte) times the micro-batches a stage holds,
and the buffers."""

from __future__ import annotations

from parallel.measure import activations
from parallel.measure.formulas import model_state
from parallel.plan.hardware import GiB
from parallel.plan.layouts import ELEM, OPTIMIZERS, Layout, Training, micro_batches
from parallel.plan.models import ModelShape
from parallel.plan.stages import Stage, stages


def params_per_gpu(model: ModelShape, lay: Layout, stage: str = "first") -> tuple[float, float]:
    """(dense, expert) parameters on the first or the last rank of an even pipeline (pp = 1: the only one)
    before any ZeRO sharding: stage_params of that rank."""
    ends = lay.pp == 1
    return stage_params(model, lay, Stage(0, lay.layers(model.layers), embedding=ends or stage == "first",
                                          head=ends or stage == "last"))


def stage_params(model: ModelShape, lay: Layout, st: Stage) -> tuple[float, float]:
    """(dense, expert) parameters a rank of stage `st` holds before any ZeRO sharding: its layers, split by tp
    (experts by tp x ep); the embedding's rank adds the token (and position) embedding, the head's the head (a
    tied head's copy too, as Megatron and nanotron keep one there) and the final norm; a rank with both holds
    a tied head once."""
    experts = model.expert_params * model.experts * st.layers / (lay.tp * lay.ep) if model.experts else 0.0
    dense = (model.layer_params - (model.expert_params * model.experts if model.experts else 0)) * st.layers / lay.tp
    positions = model.seq * model.hidden if model.arch == "gpt" else 0
    head = model.vocab * (model.hidden + (model.arch == "gpt" and not model.head_tied)) + model.norm_params // 2
    extra = (model.vocab * model.hidden + positions) * st.embedding + head * st.head
    if st.embedding and st.head and model.head_tied:
        extra -= model.vocab * model.hidden  # one GPU's tied head is the embedding itself
    return dense + extra / lay.tp, experts


def state_of(model: ModelShape, lay: Layout, train: Training, st: Stage) -> dict[str, float]:
    """Model state bytes by kind on a rank of stage `st`: dense parameters sharded (by the ZeRO stage) over
    dp x cp, expert parameters over the dp x cp / ep ranks that hold copies of the same experts; under ZeRO-0
    a stack's 16-bit gradient copy beside the fp32 one (DDP's buckets)."""
    dense, experts = stage_params(model, lay, st)
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
    if train.grad_copy_bytes and lay.zero_stage == 0:  # DDP's buckets: nanotron's ZeRO-1 ran without DDP
        state["gradients"] += sum(model_state(psi, lay.zero_stage, n, 0, train.grad_copy_bytes, 0)["gradients"]
                                  for psi, n in ((dense, shards), (experts, expert_shards)))
    return state


def layer_activations(model: ModelShape, lay: Layout, train: Training) -> float:
    """activations.formula for one layer and micro-batch on one GPU (context parallel: s/cp positions)."""
    terms = activations.formula(model.seq // lay.cp, lay.mbs, model.hidden, model.heads, lay.tp,
                                lay.sequence_parallel, "math" if train.attention == "unfused" else "fused",
                                lay.recompute, ELEM[train.precision], train.dropout, model.kv / model.heads,
                                model.F / model.hidden * (model.top_k if model.experts else 1), model.gated,
                                turned=lay.ulysses > 1)
    return sum(terms.values())


def memory(model: ModelShape, lay: Layout, train: Training) -> dict[str, float]:
    """GiB per GPU by kind on the pipeline rank that needs the most (stages.stages: the first and the last of
    an even split, every rank of a cost split): its model state, its layers' activations times the
    micro-batches it holds, and buffers: the logits where the loss is (16-bit, their fp32 copy and softmax),
    the 16-bit logits kept for backward where the head is without the loss, the recompute's working layer,
    ZeRO-3's gathered layers."""
    elem = ELEM[train.precision]
    m = micro_batches(lay, train)
    per_layer = layer_activations(model, lay, train)
    tokens = lay.tokens(model.seq)
    common = (4 * tokens * model.hidden * elem if lay.recompute == "full" else 0)  # the layer being recomputed
    if lay.zero_stage == 3:  # the gathered parameters of the layer in use and the one prefetched
        experts = model.expert_params * model.experts * (1 - 1 / lay.ep) if model.experts else 0
        common += 2 * (model.layer_params - experts) / lay.tp * elem  # a rank gathers its own experts only
    logits = tokens * model.vocab / lay.tp  # elements
    worst = None
    for st in stages(model, lay, train, m):
        # the loss's logits (16-bit, their fp32 copy and softmax) for each micro-batch a cost split's loss rank
        # holds (the last, 1; an even split's last counted once); the head's 16-bit outputs where it sends them
        held = st.held if train.partition == "cost" else 1
        ends = logits * (elem + 4 + 4) * held if st.loss else logits * elem * st.held if st.head else 0.0
        acts = per_layer * st.layers * st.held
        out = {**state_of(model, lay, train, st), "activations": acts * train.activation_scale,
               "buffers": common + ends * train.activation_scale}
        total = sum(out.values())
        if worst is None or total > worst["total"]:
            worst = {k: v / GiB for k, v in out.items()} | {"total": total}
    worst["total"] /= GiB
    return worst


def usable_gib(gpu_gib: float, train: Training) -> float:
    """What a run's tensors can fill of a GPU: the memory no tensor holds (the CUDA context, NCCL's buffers)
    taken out, and of the rest the share the caching allocator can hand out (Training.memory_usable)."""
    return (gpu_gib - train.memory_fixed_gib) * train.memory_usable
