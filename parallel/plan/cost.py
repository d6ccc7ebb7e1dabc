"""The planner's cost model: memory per GPU by kind and step time by part, for one layout.

    step = m T_stage + bubble + exposed communication (pipeline hand-offs, data parallel) + optimizer

T_stage is one micro-batch's forward and backward through the busiest stage: per layer, matrix multiplies
at the kind's efficiency for the layer's width on a GPU (h/tp), elementwise kernels at its HBM bandwidth,
and tensor-, context- and expert-parallel collectives on the ring model (hardware.ring_seconds, the one the
report fits to each run). The bubble is the schedule's closed form (strategies/replay.CLOSED_FORMS, the one
the report checks against its replay of each pipeline run). Activations are activations.formula per layer
(the one each run's LayerMeter checks exactly) times the micro-batches a stage holds. docs/planner.md.
"""

from __future__ import annotations

import dataclasses
import math

from parallel import activations
from parallel.formulas import model_state
from parallel.plan.hardware import Cluster, GiB
from parallel.plan.models import ModelSpec
from parallel.strategies.replay import CLOSED_FORMS

ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: carved out of dp x cp, as torchtitan does
    mbs: int = 1  # sequences per micro-batch
    stages_per_rank: int = 1  # interleaving (v)
    zero_stage: int = 0
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    schedule: str = "1f1b"

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def layers(self, model_layers: int) -> int:
        """Layers on the busiest rank: stages of ceil(L / (pp v)) layers, v of them (pp need not divide L:
        Llama 3 405B ran 126 layers in 16 stages)."""
        return math.ceil(model_layers / (self.pp * self.stages_per_rank)) * self.stages_per_rank

    def describe(self) -> str:
        """tp4 pp16 dp16 mbs1 v3 z1 sp sel: the dimensions over 1, micro-batch, interleaving, ZeRO stage,
        sequence parallel, recompute (sel | full)."""
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "dp", "cp", "ep") if getattr(self, k) > 1] or ["dp1"]
        parts += [f"mbs{self.mbs}"] + ([f"v{self.stages_per_rank}"] if self.stages_per_rank > 1 else [])
        parts += [f"z{self.zero_stage}"] * (self.zero_stage > 0) + ["sp"] * self.sequence_parallel
        parts += [{"none": "", "selective": "sel", "full": "full"}[self.recompute]]
        parts += [self.schedule] * (self.schedule != "1f1b")
        return " ".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class Training:
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"
    attention: str = "flash"  # flash: fused kernel, no s^2 tensors, causal half skipped; unfused: Megatron 2021-22
    dropout: bool = False  # Megatron's published runs: dropout on (masks kept, more elementwise traffic)
    grad_bytes: int = 4  # fp32 gradients (Megatron's main_grad; FSDP2 reduces in fp32 by default)
    dp_overlap: bool = True  # data-parallel collectives under backward (DDP, FSDP2); Megatron 2021-22: False
    pp_scatter_gather: bool = True  # Narayanan's: a hand-off sends 1/tp of the activation across nodes
    optimizer_bytes: int = 12  # fp32 master copy, Adam's two moments (a fp32 run has no master: 8)


def params_per_gpu(model: ModelSpec, lay: Layout, stage: str = "first") -> tuple[float, float]:
    """(dense, expert) parameters on a GPU of the `stage` ("first" or "last") before any ZeRO sharding: its
    layers, split by tp (experts by tp x ep); the first stage adds the token (and position) embedding, the
    last the head (a tied head's copy too, as Megatron keeps one there) and the final norm; pp = 1 both."""
    layers = lay.layers(model.layers)
    experts = model.expert_params * model.experts * layers / (lay.tp * lay.ep) if model.experts else 0.0
    dense = (model.layer_params - (model.expert_params * model.experts if model.experts else 0)) * layers / lay.tp
    positions = model.seq * model.hidden if model.arch == "gpt" else 0
    head = model.vocab * model.hidden + model.norm_params // 2
    ends = {"first": model.vocab * model.hidden + positions, "last": head}
    extra = sum(ends.values()) - (model.vocab * model.hidden if model.arch == "gpt" else 0) if lay.pp == 1 \
        else ends[stage]  # one GPU, a tied head is the embedding itself
    return dense + extra / lay.tp, experts


def state_of(model: ModelSpec, lay: Layout, train: Training, stage: str = "first") -> dict[str, float]:
    """Model state bytes by kind: dense parameters sharded (by the ZeRO stage) over dp x cp, expert
    parameters over the dp x cp / ep ranks that hold copies of the same experts."""
    dense, experts = params_per_gpu(model, lay, stage)
    shards = lay.dp * lay.cp
    sizes = (4, 4, train.optimizer_bytes - 4) if train.precision == "fp32" else \
        (ELEM[train.precision], train.grad_bytes, train.optimizer_bytes)
    state = model_state(dense, lay.zero_stage, shards, *sizes)
    if experts:
        for k, v in model_state(experts, lay.zero_stage, max(1, shards // lay.ep), *sizes).items():
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
    tokens = lay.mbs * model.seq / lay.cp
    common = (4 * tokens * model.hidden * elem if lay.recompute == "full" else 0)  # the layer being recomputed
    if lay.zero_stage == 3:  # the gathered parameters of the layer in use and the one prefetched
        common += 2 * model.layer_params / lay.tp * elem
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


def micro_batches(lay: Layout, train: Training) -> int:
    return max(1, train.global_batch // (lay.dp * lay.mbs))


@dataclasses.dataclass
class Parts:
    """Seconds of one micro-batch through one layer on one GPU: forward and backward, each with the
    collectives on its path; `comm` says how much of them was communication, by dimension."""
    forward: float = 0.0
    backward: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)

    def add_comm(self, dim: str, forward: float, backward: float) -> None:
        self.forward, self.backward = self.forward + forward, self.backward + backward
        self.comm[dim] = self.comm.get(dim, 0.0) + forward + backward

    @property
    def compute(self) -> float:
        return self.forward + self.backward - sum(self.comm.values())


def layer_time(model: ModelSpec, lay: Layout, train: Training, cl: Cluster) -> Parts:
    e, elem = cl.gpu.efficiency, ELEM[train.precision]
    peak = cl.peak(train.precision) * e.matmul(model.hidden / lay.tp)
    hbm = cl.gpu.hbm * e.memory
    q_len = model.seq / lay.cp
    tokens = lay.mbs * q_len
    mm = model.layer_matmul_flops(tokens) / lay.tp / peak
    core = model.core_flops(lay.mbs, q_len) / lay.tp / peak * (0.5 if train.attention == "flash" else 1.0)
    whole = tokens * model.hidden / (lay.tp if lay.sequence_parallel else 1)
    # elementwise bytes of a forward: two norms (read, write), two residual adds with dropout (read two,
    # write one, a mask), the MLP's activation (read, write; SwiGLU reads two), the softmax (and dropout)
    # on the s^2 scores where the kernel is not fused
    scores = lay.mbs * model.heads * q_len * model.seq / lay.tp
    mlp = tokens * model.F / lay.tp * (model.top_k if model.experts else 1)
    moved = whole * elem * (2 * 2 + 2 * 3) + train.dropout * 2 * whole + mlp * elem * (3 if model.gated else 2)
    softmax = scores * (2 * elem + train.dropout * (1 + 2 * elem)) if train.attention == "unfused" else 0.0
    ew, ew_core = moved / hbm, softmax / hbm
    t = Parts(mm + core + ew + ew_core, 2 * (mm + core + ew + ew_core))
    if lay.recompute == "full":
        t.backward += t.forward
    elif lay.recompute == "selective":
        t.backward += core + ew_core
    if lay.tp > 1:  # Megatron: 2 all-reduces forward, 2 backward (SP: reduce-scatter + all-gather pairs,
        act = tokens * model.hidden * elem  # the same bytes), 2 more in a full recompute; SP's backward
        n = 4 + 2 * (lay.recompute == "full")  # gathers its inputs again (2 all-gathers = 1 all-reduce)
        n += lay.sequence_parallel
        one = cl.collective_s("all_reduce", act, lay.tp)
        t.add_comm("tp", 2 * one, (n - 2) * one)
    if lay.cp > 1:  # ring attention: K and V around the ring forward, with dK, dV back in backward; hidden
        kv = 2 * tokens * model.hidden * model.kv / model.heads / lay.tp * elem  # under the attention core
        ring = (lay.cp - 1) * cl.collective_s("send", kv, 2, lay.cp * lay.tp)
        t.add_comm("cp", max(0.0, ring - core), max(0.0, 2 * ring - 2 * core))
    if model.experts and lay.ep > 1:  # dispatch and combine all-to-alls, forward and backward
        rows = tokens * model.top_k * model.hidden * elem
        one = cl.collective_s("all_to_all", rows, lay.ep, lay.ep * lay.cp * lay.tp)
        t.add_comm("ep", 2 * one, 2 * one)
    return t


def head_time(model: ModelSpec, lay: Layout, train: Training, cl: Cluster) -> float:
    """The last stage's extra: the output projection to the vocabulary and the loss, forward and back."""
    tokens = lay.mbs * model.seq / lay.cp
    peak = cl.peak(train.precision) * cl.gpu.efficiency.matmul(model.hidden / lay.tp)
    loss = tokens * model.vocab / lay.tp * 16 / (cl.gpu.hbm * cl.gpu.efficiency.memory)
    return 3 * model.logits_flops(tokens) / lay.tp / peak + loss


def dp_traffic(psi: float, lay: Layout, train: Training) -> list[tuple[str, float, int]]:
    """The data-parallel collectives of a step, as (kind, bytes of the whole tensor, times): ZeRO-0 one
    all-reduce of the gradients; ZeRO-1 a reduce-scatter of them and an all-gather of the updated
    parameters; ZeRO-2 the reduce-scatter every micro-batch (no whole gradient is kept to accumulate
    into); ZeRO-3 (FSDP) every micro-batch gathers the parameters for forward and for backward (and
    for a full recompute) and reduce-scatters the gradients. The strategies' comm_bytes_predicted are the
    same collectives (tests/test_plan.py holds them equal; each run measures them)."""
    param = 4 if train.precision == "fp32" else ELEM[train.precision]
    grads = psi * train.grad_bytes
    if lay.zero_stage == 3:
        gathers = 2 + (lay.recompute == "full")
        m = micro_batches(lay, train)
        return [("all_gather", psi * param, gathers * m), ("reduce_scatter", grads, m)]
    if lay.zero_stage in (1, 2):
        times = micro_batches(lay, train) if lay.zero_stage == 2 else 1
        return [("reduce_scatter", grads, times), ("all_gather", psi * param, 1)]
    return [("all_reduce", grads, 1)]


USABLE = 0.95  # of a GPU's memory a run can fill: the CUDA context, NCCL's buffers and fragmentation take the rest


def schedule_of(lay: Layout) -> str:
    return "interleaved1f1b" if lay.stages_per_rank > 1 and lay.schedule == "1f1b" else lay.schedule


def predict(model: ModelSpec, lay: Layout, train: Training, cl: Cluster) -> dict:
    """One layout's prediction: step time by part, throughput, memory by kind and whether it fits."""
    e, elem = cl.gpu.efficiency, ELEM[train.precision]
    m, p, v = micro_batches(lay, train), lay.pp, lay.stages_per_rank
    layers = lay.layers(model.layers)
    lt = layer_time(model, lay, train, cl)
    head = head_time(model, lay, train, cl)
    busiest = layers * (lt.forward + lt.backward) + head  # the last stage (pp = 1: the only one)
    f, b = layers * lt.forward / v, layers * lt.backward / v  # one chunk
    bubble = max(0.0, CLOSED_FORMS[schedule_of(lay)](p, f, b, b / 2, b / 2)) if p > 1 else 0.0
    parts = {"compute": m * (layers * lt.compute + head), "bubble": bubble}
    comm = {dim: m * layers * s for dim, s in lt.comm.items()}
    if p > 1:  # each micro-batch's hand-offs, forward and back, once per chunk a rank holds
        act = lay.mbs * model.seq / lay.cp * model.hidden * elem / (lay.tp if train.pp_scatter_gather else 1)
        span = lay.tp * lay.cp * lay.dp + 1  # pipeline neighbours sit a data-parallel group apart
        comm["pp"] = 2 * v * m * cl.collective_s("send", act, 2, span)
    dense, experts = max(params_per_gpu(model, lay, "first"), params_per_gpu(model, lay, "last"))
    shards, span = lay.dp * lay.cp, lay.dp * lay.cp * lay.tp
    dp = sum(count * cl.collective_s(kind, nbytes, shards, span)
             for kind, nbytes, count in dp_traffic(dense, lay, train))
    if experts:  # expert weights: reduced over the dp x cp / ep ranks that hold the same experts
        dp += sum(count * cl.collective_s(kind, nbytes, max(1, shards // lay.ep), span // lay.ep)
                  for kind, nbytes, count in dp_traffic(experts, lay, train))
    if lay.zero_stage == 3:  # FSDP's gathers prefetch under the whole step's compute
        hidden = parts["compute"] if train.dp_overlap else 0.0
    else:  # DDP's buckets all-reduce under the last micro-batch's backward
        hidden = layers * lt.compute / 1.5 if train.dp_overlap else 0.0  # backward: 2/3 of the arithmetic
    if shards > 1:
        comm["dp"] = max(0.0, dp - hidden)
    owned = dense / (shards if lay.zero_stage else 1) + experts / (max(1, shards // lay.ep) if lay.zero_stage else 1)
    optimizer = owned * 30 / (cl.gpu.hbm * e.memory)  # Adam: 30 bytes a parameter it owns
    parts["optimizer"] = optimizer
    step = m * busiest + bubble + sum(v for k, v in comm.items() if k in ("pp", "dp")) + optimizer
    gpus = lay.gpus
    flops = model.model_flops(train.global_batch)
    tokens = train.global_batch * model.seq
    redo = {"none": 0.0, "selective": model.core_flops(1, model.seq) * model.layers,
            "full": (model.layer_matmul_flops(model.seq) + model.core_flops(1, model.seq)) * model.layers}
    hw = flops + redo[lay.recompute] * train.global_batch
    mem = memory(model, lay, train)
    return {"layout": dataclasses.asdict(lay), "describe": lay.describe(), "gpus": gpus, "micro_batches": m,
            "step_s": step, "parts_s": parts, "exposed_comm_s": comm,
            "tokens_per_s_per_gpu": tokens / step / gpus, "tflops_per_gpu": flops / step / gpus / 1e12,
            "hw_tflops_per_gpu": hw / step / gpus / 1e12, "mfu": flops / step / gpus / cl.peak(train.precision),
            "memory_gib": mem, "fits": mem["total"] <= cl.gpu.memory_gib * USABLE,
            "flops": "model FLOPs: 6 x matmul parameters per token + 12 L h s (full attention), no recompute"}
