"""The planner's cost model: memory per GPU by kind and step time by part, for one layout.

    step = m T_stage + bubble + exposed communication (pipeline hand-offs, data parallel) + optimizer

T_stage is one micro-batch's forward and backward through the busiest stage: per layer, matrix multiplies
at the kind's efficiency for the layer's width on a GPU (h/tp), elementwise kernels at its HBM bandwidth,
and tensor-, context- and expert-parallel collectives on the ring model (hardware.ring_seconds, the one the
report fits to each run). The bubble is the schedule's closed form (measure/replay.CLOSED_FORMS, the one
the report checks against its replay of each pipeline run). Each piece (a layer's forward, its backward, the
head, the optimizer) takes at least the host's time to launch its kernels (`launched`). Activations are
activations.formula per layer (the one each run's LayerMeter checks exactly) times the micro-batches a stage
holds. docs/planner.md.
"""

from __future__ import annotations

import dataclasses

from parallel.kit.ulysses import kv_heads_sent
from parallel.measure.replay import CLOSED_FORMS
from parallel.plan.hardware import Cluster
from parallel.plan.layouts import ELEM, OPTIMIZERS, Layout, Training, micro_batches, weight_bytes
from parallel.plan.memory import memory, stage_params, usable_gib
from parallel.plan.models import ModelShape
from parallel.plan.stages import stages


@dataclasses.dataclass
class Parts:
    """Seconds of one micro-batch through one layer on one GPU: forward and backward, each with the
    collectives on its path; `comm` says how much of them was communication, by dimension, and `overhead`
    how much went to kernels rather than in them (the GPU's gaps, or waiting for the host's launches)."""
    forward: float = 0.0
    backward: float = 0.0
    comm: dict = dataclasses.field(default_factory=dict)
    overhead: float = 0.0

    @property
    def compute(self) -> float:
        return self.forward + self.backward - sum(self.comm.values()) - self.overhead


# Kernels eager PyTorch launches in a training step, counted by the profiler on GPT-2 small under bf16
# autocast (one H100, torch 2.11, 2026-11-26): 84 a block, forward and backward, and 46 outside the blocks
# (1,054 at 12 blocks, 214 at 2, micro-batch 1; larger tensors split a few more). Forward is taken as a
# third of a block's (backward runs two matmuls for each of forward's); the 46 split by the ops that run
# them: the final norm, head and loss 20, the embeddings, fused AdamW and the loss's read-back 26.
KERNELS = {"forward": 28, "backward": 56, "head": 20, "step": 26}


def launched(device_s: float, kernels: float, cl: Cluster, host: float = 1.0) -> tuple[float, float]:
    """(seconds, of which overhead) of a piece of a step that does `device_s` of arithmetic and memory traffic
    in `kernels` kernels: the GPU's time, with its gap between kernels, or the host's time to launch them where
    that is longer (`host`: the stack's time per kernel over eager torch's). The GPU cannot start a kernel the
    host has not launched; the host is taken not to run ahead of the GPU from one piece to the next (each
    piece's overhead is paid, not pooled)."""
    e = cl.gpu.efficiency
    t = max(device_s + kernels * e.gap_s, kernels * e.launch_s * host)
    return t, t - device_s


def layer_traffic(model: ModelShape, lay: Layout, train: Training) -> dict[str, tuple[str, float, int, int]]:
    """One layer's collectives on one micro-batch, by dimension: (kind, bytes of the tensor, times forward, times
    backward). Tensor parallel (Megatron): 2 all-reduces of the activation forward and 2 backward; sequence
    parallel swaps each for a reduce-scatter and an all-gather of the same bytes, and backward gathers its
    inputs again (2 all-gathers: one all-reduce's bytes). A full recompute runs each dimension's forward
    collectives again in backward. Context parallel (ring attention): K and V passed cp - 1 times forward, K, V
    and dK, dV twice that backward: 3 (cp - 1) blocks, as this project's ring sends
    (measure/context.py's attention_bytes_predicted). Ulysses (U of the cp ranks by all-to-all): q, k, v and
    out turned forward and their gradients backward, k and v with the kv heads they carry, and a ring of the
    other R = cp / U with H / U heads of s / R positions, K, V repeated to them as this project's ring
    needs (a2a_bytes_predicted; grouped ones would send K / H of it). Experts: the dispatch and
    combine all-to-alls, forward and backward. tests/test_plan.py holds them to the bytes the tensor- and
    context-parallel runs predict and measure."""
    elem = ELEM[train.precision]
    tokens = lay.tokens(model.seq)
    out = {}
    if lay.tp > 1:
        backward = 2 + 2 * (lay.recompute == "full") + lay.sequence_parallel
        out["tp"] = ("all_reduce", tokens * model.hidden * elem, 2, backward)
    redo = lay.recompute == "full"  # backward runs the forward's collectives again
    u, ring = lay.ulysses, lay.cp // lay.ulysses
    if u > 1:
        kv = kv_heads_sent(model.kv // lay.tp, u) / (model.heads // lay.tp)  # k, v's share of q's bytes
        out["a2a"] = ("all_to_all", (2 + 2 * kv) * tokens * model.hidden / lay.tp * elem, 1, 1 + redo)
    if ring > 1:
        share = model.kv / model.heads if u == 1 else 1.0  # the hybrid's ring: K, V repeated to its H/U heads
        kv = 2 * tokens * u * model.hidden / u * share / lay.tp * elem  # K, V of s / ring positions
        out["cp"] = ("send", kv, ring - 1, (2 + redo) * (ring - 1))
    if model.experts and lay.ep > 1:
        out["ep"] = ("all_to_all", tokens * model.top_k * model.hidden * elem, 2, 2 + 2 * redo)
    return out


def matmul_time(model: ModelShape, lay: Layout, train: Training, cl: Cluster, tokens: float) -> tuple[float, float]:
    """Seconds of one layer's weight matrix products on one GPU, forward and backward. A kind whose
    efficiency was fitted to whole layers (the A100's, Efficiency.per_gemm False) runs them all at the
    layer's width on a GPU (h / tp), backward twice forward. A kind whose matrix products were timed one by
    one (the H100's) runs each at its own contraction: forward Y = XW over W's rows (h for the column-parallel
    q, k, v and MLP inputs, h/tp or F/tp for the row-parallel outputs), backward dX over W's columns and dW
    over the tokens."""
    e = cl.gpu.efficiency
    if not e.per_gemm:
        mm = model.layer_matmul_flops(tokens) / lay.tp / cl.matmul_rate(train.precision, model.hidden / lay.tp)
        return mm, 2 * mm
    h, t, F = model.hidden, lay.tp, model.F
    k = model.top_k if model.experts else 1
    gemms = [(h, (h + 2 * h * model.kv // model.heads) / t), (h / t, h),  # q, k, v; the attention's output
             (h, (2 if model.gated else 1) * k * F / t), (k * F / t, h)]  # the MLP's input(s), its output
    peak = cl.peak(train.precision)
    fwd = sum(2 * tokens * K * N / (peak * e.matmul(K)) for K, N in gemms)
    bwd = sum(2 * tokens * K * N / (peak * e.matmul(N)) + 2 * tokens * K * N / (peak * e.matmul(tokens))
              for K, N in gemms)
    return fwd, bwd


def layer_time(model: ModelShape, lay: Layout, train: Training, cl: Cluster) -> Parts:
    e, elem = cl.gpu.efficiency, ELEM[train.precision]
    peak = cl.matmul_rate(train.precision, model.hidden / lay.tp)
    hbm = cl.gpu.hbm * e.memory
    q_len = model.seq / lay.cp
    tokens = lay.tokens(model.seq)
    mm_f, mm_b = matmul_time(model, lay, train, cl, tokens)
    core_rate = cl.peak(train.precision) * e.attention if e.attention and train.attention == "flash" else peak
    core = model.core_flops(lay.mbs, q_len) / lay.tp / core_rate * (0.5 if train.attention == "flash" else 1.0)
    whole = tokens * model.hidden / (lay.tp if lay.sequence_parallel else 1)
    # elementwise bytes of a forward: two norms (read, write), two residual adds with dropout (read two,
    # write one, a mask), the MLP's activation (read, write; SwiGLU reads two), the softmax (and dropout)
    # on the s^2 scores where the kernel is not fused
    scores = lay.mbs * model.heads * q_len * model.seq / lay.tp
    mlp = tokens * model.F / lay.tp * (model.top_k if model.experts else 1)
    moved = whole * elem * (2 * 2 + 2 * 3) + train.dropout * 2 * whole + mlp * elem * (3 if model.gated else 2)
    softmax = scores * (2 * elem + train.dropout * (1 + 2 * elem)) if train.attention == "unfused" else 0.0
    ew, ew_core = moved * train.elementwise / hbm, softmax / hbm
    device = {"forward": mm_f + core + ew + ew_core, "backward": mm_b + 2 * (core + ew + ew_core)}
    launches = {k: KERNELS[k] for k in device}
    if lay.recompute == "full":  # backward runs the forward again first
        device["backward"] += device["forward"]
        launches["backward"] += launches["forward"]
    elif lay.recompute == "selective":
        device["backward"] += core + ew_core
    comm = {"forward": {}, "backward": {}}
    for dim, (kind, nbytes, forward, backward) in layer_traffic(model, lay, train).items():
        group, span = {"tp": (lay.tp, lay.tp), "cp": (2, lay.cp * lay.tp), "a2a": (lay.ulysses, lay.ulysses * lay.tp),
                       "ep": (lay.ep, lay.ep * lay.cp * lay.tp)}[dim]
        one = cl.collective_s(kind, nbytes, group, span)
        hidden = core if dim == "cp" else 0.0  # the ring's passes run under the attention core
        comm["forward"][dim] = max(0.0, forward * one - hidden)
        comm["backward"][dim] = max(0.0, backward * one - backward / forward * hidden)
    # The collectives are the GPU's work too: the host launches them among the kernels and runs on while
    # the GPU waits in them, so a host-bound layer hides them (nanotron's tp 8 at one sequence a micro-batch)
    t = Parts()
    for k in device:
        total, over = launched(device[k] + sum(comm[k].values()), launches[k], cl, train.host)
        setattr(t, k, total)
        t.overhead += over
    for k in comm["forward"]:
        t.comm[k] = comm["forward"][k] + comm["backward"][k]
    return t


def head_time(model: ModelShape, lay: Layout, train: Training, cl: Cluster, head: bool = True,
              loss: bool = True) -> tuple[float, float]:
    """The last stage's extra: the output projection to the vocabulary and the loss, forward and back
    (seconds, of which launch overhead); `head` or `loss` alone where a cost split puts them on two ranks
    (each launching half the kernels)."""
    tokens = lay.tokens(model.seq)
    e, one = cl.gpu.efficiency, model.logits_flops(tokens) / lay.tp
    if e.per_gemm:  # column-parallel: forward over h, backward dX over V/tp and dW over the tokens
        projection = sum(one / (cl.peak(train.precision) * e.matmul(x)) for x in (model.hidden,
                                                                                 model.vocab / lay.tp, tokens))
    else:
        projection = 3 * one / cl.matmul_rate(train.precision, model.hidden / lay.tp)
    moved = tokens * model.vocab / lay.tp * train.loss_bytes / (cl.gpu.hbm * e.memory)
    device = head * projection + loss * moved
    return launched(device, KERNELS["head"] * (head + loss) / 2, cl, train.host) if head or loss else (0, 0)


def dp_traffic(psi: float, lay: Layout, train: Training) -> list[tuple[str, float, int]]:
    """The data-parallel collectives of a step, as (kind, bytes of the whole tensor, times): ZeRO-0 one
    all-reduce of the gradients; ZeRO-1 a reduce-scatter of them and an all-gather of the updated
    parameters; ZeRO-2 the reduce-scatter every micro-batch (no whole gradient is kept to accumulate
    into); ZeRO-3 (FSDP) every micro-batch gathers the parameters for forward and for backward (and
    for a full recompute) and reduce-scatters the gradients. The strategies' comm_bytes_predicted are the
    same collectives (tests/test_plan.py holds them equal; each run measures them)."""
    param = weight_bytes(train)
    grads = psi * train.grad_bytes
    if lay.zero_stage == 3:
        gathers = 2 + (lay.recompute == "full")
        m = micro_batches(lay, train)
        return [("all_gather", psi * param, gathers * m), ("reduce_scatter", grads, m)]
    if lay.zero_stage in (1, 2):
        times = micro_batches(lay, train) if lay.zero_stage == 2 else 1
        return [(train.zero_reduce, grads, times), ("all_gather", psi * param, 1)]
    return [("all_reduce", grads, 1)]


def schedule_of(lay: Layout) -> str:
    return "interleaved1f1b" if lay.stages_per_rank > 1 and lay.schedule == "1f1b" else lay.schedule


def pipeline(model: ModelShape, lay: Layout, train: Training, cl: Cluster, lt: Parts, ranks: list) -> dict:
    """One micro-batch through the busiest rank, and the bubble. Even split: that rank is the last (its
    layers and the head), the bubble the schedule's closed form on its layers, and the hand-offs exposed
    apart (Narayanan's scatter/gather). Cost split (nanotron): every rank's layers, its ends, and its
    blocking sends and receives, forward and back (the logits where the head sits one rank before the
    loss); a pipeline of unequal stages takes sum(T_r) + (m - 1) max(T_r), so its bubble is the other
    ranks' sum."""
    elem, p, v = ELEM[train.precision], lay.pp, lay.stages_per_rank
    act = lay.tokens(model.seq) * model.hidden * elem
    if train.partition == "even" or p == 1 or v > 1:
        layers = lay.layers(model.layers)
        head, head_over = head_time(model, lay, train, cl)
        f, b = layers * lt.forward / v, layers * lt.backward / v  # one chunk
        bubble = max(0.0, CLOSED_FORMS[schedule_of(lay)](p, f, b, b / 2, b / 2)) if p > 1 else 0.0
        handoff = 2 * v * cl.collective_s("send", act / (lay.tp if train.pp_scatter_gather else 1), 2,
                                          lay.tp * lay.cp * lay.dp + 1) if p > 1 else 0.0
        return {"stage": layers * (lt.forward + lt.backward) + head, "layers": layers, "head": head,
                "head_over": head_over, "bubble": bubble, "handoff": handoff, "handoff_in_stage": False}
    span = lay.tp * lay.cp * lay.dp + 1  # pipeline neighbours sit a data-parallel group apart
    logits = lay.tokens(model.seq) * model.vocab / lay.tp * elem
    sizes = [logits if st.head and not st.loss else act / (lay.tp if lay.sequence_parallel else 1) for st in ranks]
    times = []
    for st in ranks:
        head, head_over = head_time(model, lay, train, cl, st.head, st.loss)
        # a rank with no blocks (more ranks than blocks) passes nothing on, and costs nothing
        empty = not (st.layers or st.embedding or st.head or st.loss)
        sends = 0.0 if empty else sum(2 * cl.collective_s("send", sizes[r], 2, span)
                                      for r in (st.rank - 1, st.rank) if 0 <= r < p - 1)
        times.append({"stage": st.layers * (lt.forward + lt.backward) + head + sends, "layers": st.layers,
                      "head": head, "head_over": head_over, "handoff": sends})
    busiest = max(times, key=lambda t: t["stage"])
    return busiest | {"bubble": sum(t["stage"] for t in times) - busiest["stage"], "handoff_in_stage": True}


def predict(model: ModelShape, lay: Layout, train: Training, cl: Cluster) -> dict:
    """One layout's prediction: step time by part, throughput, memory by kind and whether it fits."""
    e = cl.gpu.efficiency
    m = micro_batches(lay, train)
    lt = layer_time(model, lay, train, cl)
    ranks = stages(model, lay, train, m)  # the ranks whose time or memory can be the largest (stages.py)
    pipe = pipeline(model, lay, train, cl, lt, ranks)
    layers, head, head_over, bubble = pipe["layers"], pipe["head"], pipe["head_over"], pipe["bubble"]
    parts = {"compute": m * (layers * lt.compute + head - head_over), "bubble": bubble}
    comm = {dim: m * layers * s for dim, s in lt.comm.items()}
    if lay.pp > 1:  # each micro-batch's hand-offs, forward and back, once per chunk a rank holds
        comm["pp"] = m * pipe["handoff"]
    dense, experts = max(stage_params(model, lay, st) for st in ranks)
    (shards, expert_shards), span = lay.shards(), lay.dp * lay.cp * lay.tp
    # ZeRO-1/2's all-gather of the updated parameters comes after the step: nothing of backward is left to
    # hide it under (ZeRO-3's gathers prefetch under the next layers instead)
    after = lay.zero_stage in (1, 2)
    dp, exposed = 0.0, 0.0
    for psi, group in ((dense, shards), (experts, expert_shards)):  # experts' holders strided: as wide
        for kind, nbytes, count in dp_traffic(psi, lay, train) if psi else []:
            t = count * cl.collective_s(kind, nbytes, group, span)
            dp, exposed = (dp, exposed + t) if after and kind == "all_gather" else (dp + t, exposed)
    overlap = train.dp_overlap and (train.zero_overlap or lay.zero_stage not in (1, 2))
    if lay.zero_stage == 3:  # FSDP's gathers prefetch under the whole step's compute
        hidden = parts["compute"] if overlap else 0.0
    else:  # DDP's buckets all-reduce under the last micro-batch's backward
        # backward is 2/3 of the arithmetic; ZeRO-2's reduce-scatter runs under every micro-batch's
        hidden = (m if lay.zero_stage == 2 else 1) * layers * lt.compute / 1.5 if overlap else 0.0
    if shards > 1:
        comm["dp"] = max(0.0, dp - hidden) + exposed
    owned = dense / (shards if lay.zero_stage else 1) + experts / (expert_shards if lay.zero_stage else 1)
    # Adam: 30 bytes a parameter it owns (OPTIMIZERS); the step's kernels outside the layers launch around it
    moved = OPTIMIZERS[train.optimizer][0]
    optimizer, step_over = launched(owned * moved / (cl.gpu.hbm * e.memory), KERNELS["step"], cl, train.host)
    parts["optimizer"] = optimizer - step_over
    parts["overhead"] = m * (layers * lt.overhead + head_over) + step_over
    exposed_pp = 0.0 if pipe["handoff_in_stage"] else comm.get("pp", 0.0)
    step = m * pipe["stage"] + bubble + exposed_pp + comm.get("dp", 0.0) + optimizer
    gpus = lay.gpus
    flops = model.model_flops(train.global_batch)
    tokens = train.global_batch * model.seq
    redo = {"none": 0.0, "selective": model.core_flops(1, model.seq) * model.layers,
            "full": (model.layer_matmul_flops(model.seq) + model.core_flops(1, model.seq)) * model.layers}
    hw = flops + redo[lay.recompute] * train.global_batch
    mem = memory(model, lay, train)
    short = train.fill and lay.pp > 1 and m < lay.pp - 1  # the engine refuses it at the start
    return {"layout": dataclasses.asdict(lay), "describe": lay.describe(), "gpus": gpus, "micro_batches": m,
            "step_s": step, "parts_s": parts, "exposed_comm_s": comm,
            "tokens_per_s_per_gpu": tokens / step / gpus, "tflops_per_gpu": flops / step / gpus / 1e12,
            "hw_tflops_per_gpu": hw / step / gpus / 1e12, "mfu": flops / step / gpus / cl.peak(train.precision),
            "memory_gib": mem, "fits": mem["total"] <= usable_gib(cl.gpu.memory_gib, train) and not short,
            **({"refused": f"{m} micro-batches, fewer than pp - 1 = {lay.pp - 1}: the stack's 1F1B asserts it"}
               if short else {}),
            "flops": "model FLOPs: 6 x matmul parameters per token + 12 L h s (full attention), no recompute"}
