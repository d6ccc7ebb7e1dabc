"""The sharded family: data parallel, whole and sharded. Every rank (or replica) the whole model and every
gradient averaged (single, manual_dp, data_parallel in one process: `Replicas`; ddp, manual_ddp: one
all-reduce of every gradient, `AllReduce`), or the model state sharded by the ZeRO paper's stages (zero:
stages 1-2 by hand, `Zero`; zero_optimizer: torch's ZeroRedundancyOptimizer, `ZeroRedundancy`; fsdp: FSDP2,
stage 3, `FullyShard`). What each rank holds by kind beside the paper's formula, the bytes by collective,
ddp's exposed communication, the textbook bytes and the cost model's step; the report's tables, note and
pictures of them. The strategies lend what the measurement needs (see each family's docstring):

    MEASURE = sharded.AllReduce(buckets=_bucket_bytes, options=..., step=_step)      # ddp
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as td
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from parallel import charts, measure
from parallel.devices import synchronizer
from parallel.formulas import element_bytes, sgd_state, wire_bytes
from parallel.kit.collectives import all_gather, every_rank, reduce_scatter
from parallel.kit.tensors import optimizer_state_bytes, param_bytes, tensor_bytes
from parallel.outputs import call
from parallel.results import Measured
from parallel.tables import size, table
from parallel.timing import StepTimer, summarize
from parallel.usermodel import workload_of

FAMILY = "sharded"
EXTRAS_BUDGET_S = 10.0  # seconds ddp's interleaved rounds may take: all 10 on small models, 1 at real sizes


@dataclass
class Result:
    """What a data-parallel row measured beyond its time and bytes (details["sharded"]). The model state by
    kind is every rank's, in rank order."""

    FAMILY: ClassVar[str] = FAMILY
    zero_stage: int | None = None  # the ZeRO stage its model state follows (0: ddp, the unsharded reference of
    #   the sharded table); None: not in that table
    param_bytes_per_rank: list[int] | None = None
    grad_bytes_per_rank: list[int] | None = None
    optimizer_state_bytes_per_rank: list[int] | None = None
    zero_formula_bytes: float | None = None  # the paper's model state per rank for fp32 SGD with momentum
    unsharded_peak_bytes_per_rank: list[int] | None = None  # fsdp: the most gathered parameters held at once
    owned_param_bytes_per_rank: list[int] | None = None  # zero_optimizer: whole parameters owned, greedily
    fsdp_groups: list[str] | None = None  # fsdp: the modules that became FSDP groups, the root last
    bucket_bytes: list[int] | None = None  # ddp, manual_ddp, zero: each gradient bucket, in backward's order
    all_reduces_per_step: float | None = None  # ddp, manual_ddp: the loop's count (warm-up steps)
    step_ms: float | None = None  # ddp: a step, and the same step with no all-reduce (no_sync), timed
    no_sync_step_ms: float | None = None  # interleaved after the run
    step_phases_ms: dict[str, float] | None = None  # manual_dp: the median ms of each phase of its step


def result(row) -> Result | None:
    return measure.result_of(row, Result)


# The textbook and the cost model -------------------------------------------------------------------------


def ring_allreduce_bytes(payload_bytes: float, world: int) -> float:
    """Bytes each rank sends to all-reduce `payload_bytes` with a ring: reduce-scatter then all-gather,
    each moving (N-1)/N of the payload (the nccl-tests busbw convention; the planner's formulas.wire_bytes)."""
    return wire_bytes("all_reduce", payload_bytes, world)


def grad_bytes(model: nn.Module) -> int:
    return param_bytes(p for p in model.parameters() if p.requires_grad)


def allreduce_every_gradient(model: nn.Module, config) -> float:
    """Data parallel's textbook bytes a rank sends per step (ddp, manual_ddp): every gradient all-reduced
    once, with a ring."""
    return ring_allreduce_bytes(grad_bytes(model), config.world_size)


def predict_data_parallel_ms(cal, config, accum: int) -> float | None:
    """Data parallel (ddp, manual_ddp): each rank computes its share (in `accum` pieces) and all-reduces
    every gradient once a step.
    - gloo on CPU: the all-reduce cannot hide behind compute (the ranks' threads already use every
      core), so it is added whole.
    - nccl: the buckets all-reduce on their own stream while backward goes on, so only what outlasts the
      last micro-batch's backward shows (backward is about two thirds of a step's arithmetic, twice the
      forward's), and never less than the last bucket's all-reduce, which starts when backward ends
      (the first layers' bucket; DDP's is 1 MiB)."""
    n = config.world_size
    comm = cal.allreduce_ms(cal.grad_bytes, n)
    if comm is None:
        return None
    micro = cal.compute_ms(config.batch_size // (n * accum))
    if not cal.overlaps:
        return accum * micro + comm
    return accum * micro + max(comm - 2 / 3 * micro, cal.allreduce_ms(min(cal.grad_bytes, 2**20), n))


def predict_sharded_ms(cal, config, row, all_gathers: int) -> float | None:
    """Sharded data parallel (zero, fsdp): each rank computes its share, then one reduce-scatter of the
    gradients and `all_gathers` all-gathers of the parameters, none hidden (they block in or after
    backward here; FSDP2's prefetch on GPUs would hide some: an upper bound there). The collectives' times
    are the row's own, measured in this run (timed_collectives: on gloo a reduce-scatter costs about
    an all-reduce); without them, from the all-reduce calibration: an all-gather or an nccl reduce-scatter
    is half an all-reduce's traffic, gloo's reduce-scatter a whole one (PR #118911)."""
    m, n = row.measured, config.world_size
    if m.reduce_scatter_all_grads_ms is not None and m.all_gather_all_params_ms is not None:
        comm = m.reduce_scatter_all_grads_ms + all_gathers * m.all_gather_all_params_ms
    else:
        allreduce = cal.allreduce_ms(cal.grad_bytes, n)
        if allreduce is None:
            return None
        comm = (allreduce / 2 if cal.overlaps else allreduce) + all_gathers * allreduce / 2
    return cal.compute_ms(config.batch_size // n) + comm


def timed_collectives(device: torch.device, numel: int, rounds: int = 10) -> dict[str, float]:
    """Median ms of one all-reduce, one reduce-scatter and one all-gather of `numel` fp32 elements (padded
    to a multiple of N) over the world, timed in turns round by round (the first round dropped), so that a
    drift of the machine's speed hits all three alike: what each costs here, in one run."""
    n = td.get_world_size()
    whole = torch.zeros(-(-numel // n) * n, device=device)
    part = torch.zeros(whole.numel() // n, device=device)
    work = {"all_reduce": lambda: td.all_reduce(whole), "reduce_scatter": lambda: reduce_scatter(part, whole),
            "all_gather": lambda: all_gather(whole, part)}
    timer, times = StepTimer(synchronizer(device)), {k: [] for k in work}
    for i in range(rounds + 1):
        for kind, run in work.items():
            with timer:
                run()
            if i:
                times[kind].append(timer.elapsed)
    return {k: summarize(v)["p50_ms"] for k, v in times.items()}


def measured_collectives(device: torch.device, numel: int, rounds: int) -> Measured:
    """timed_collectives as the row's declared measurements (the report's CPU caveat and the cost model
    read them)."""
    ms = timed_collectives(device, numel, rounds)
    return Measured(allreduce_all_grads_ms=ms["all_reduce"], reduce_scatter_all_grads_ms=ms["reduce_scatter"],
                    all_gather_all_params_ms=ms["all_gather"])


# The families --------------------------------------------------------------------------------------------


def held(params, optimizer) -> tuple[int, int, int]:
    """Bytes of the parameters, their gradients and the optimizer's state for them that this rank holds
    (a DTensor's local shard)."""
    params = list(params)
    return (param_bytes(params), sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
            optimizer_state_bytes(params, optimizer))


def _model_state(r: Result, mine: tuple[int, int, int], stage: int, numel: int, shards: int, element: int) -> None:
    """Every rank's (parameters, gradients, optimizer state) bytes into `r` (a collective), beside the ZeRO
    paper's model state per rank for `numel` parameters at `stage` over `shards` ranks (formulas.sgd_state:
    fp32 SGD with momentum, K = 4: DDP 12 Psi; stage 1 4 + 4 + 4/N; 2: 4 + (4 + 4)/N; 3: 12/N)."""
    params, grads, optimizer = zip(*every_rank(mine), strict=True)
    r.param_bytes_per_rank, r.grad_bytes_per_rank, r.optimizer_state_bytes_per_rank = (
        list(params), list(grads), list(optimizer))
    r.zero_stage, r.zero_formula_bytes = stage, sgd_state(numel, stage, shards, element)


def _sent(r: Result, run, **measured) -> dict:
    """A sharded row's details: its Result, and the loop's bytes by collective beside it, where the report's
    picture of them reads them for every family (ddp's are shown as one all-reduce, its whole count: its
    first step's broadcast of the rebuilt buckets' order, 24 bytes, is no collective of the algorithm)."""
    return {FAMILY: r, "bytes_per_step_by_collective": run.wire.per_step(), **measured}


class Replicas(measure.Family):
    """Data parallel inside one process (single: one replica; manual_dp by hand; data_parallel, torch's
    nn.DataParallel): every step the parameters copied out to each of the n devices, each computing its
    chunk of the batch, the gradients copied back to the first. Lent: `world_size(config)`, n (1 for
    `single`, and for data_parallel's pass-through on CPU); `phases(t)`, the PhaseTimer of its step
    (manual_dp); `copies`: the copies are seen by the loop's counter, so the textbook's bytes are set
    beside them (not nn.DataParallel's, made inside torch)."""

    name = FAMILY

    def __init__(self, world_size=None, phases=None, copies: bool = True):
        self.world_size, self.phases, self.copies = world_size or (lambda config: config.world_size), phases, copies

    def extra_measurements(self, t, data, config, dist, run) -> dict:
        if self.phases is None:
            return {}
        return {FAMILY: Result(step_phases_ms=self.phases(t).medians(skip=config.warmup))}  # the timed steps'

    def comm_bytes_predicted(self, model, config) -> float | None:
        """Bytes between the first device and the others per step: parameters out and gradients back
        (2 x params x (N-1)); inputs out, outputs back and their gradients out ((N-1)/N of each), fp32
        (fp64 under --precision fp64)."""
        if not self.copies:
            return None
        n = self.world_size(config)
        if n == 1:
            return 0  # one device: nothing to send
        workload, e = workload_of(config), element_bytes(config.precision)
        x_bytes = config.batch_size * e * math.prod(workload.input_shape)
        out_bytes = config.batch_size * e * workload.classes
        return 2 * (n - 1) * grad_bytes(model) + (n - 1) / n * (x_bytes + 2 * out_bytes)

    def predict_step_ms(self, cal, config, row) -> float:
        """Replicas compute their chunks in parallel; the parameters are copied out and the gradients back."""
        n = self.world_size(config)
        copies = cal.copy_ms(2 * (n - 1) * cal.grad_bytes) if n > 1 else 0
        return cal.compute_ms(-(-config.batch_size // n)) + copies


class AllReduce(measure.Family):
    """Every rank the whole model, every gradient all-reduced once a step (ddp, manual_ddp). Lent:
    `buckets(t)`, each bucket's bytes; `options(config)`, the strategy's options (ddp's `accum`: micro-batches
    a step, `compress`: bf16 all-reduces); `step(t, batch, sync)`, one optimiser step, without its
    all-reduce where not `sync` (ddp): with it the row times its exposed communication (the step time minus
    the same step with no all-reduce, beside one all-reduce of every gradient) and is the sharded table's
    unsharded reference, ZeRO stage 0."""

    name = FAMILY

    def __init__(self, buckets, options=None, step=None):
        self.buckets, self.options, self.step = buckets, options, step

    def _option(self, config, name: str, default):
        return getattr(self.options(config), name, default) if self.options else default

    def extra_measurements(self, t, data, config, dist, run) -> dict:
        r = Result(bucket_bytes=self.buckets(t), all_reduces_per_step=run.wire.per_step("calls").get("all_reduce", 0.0))
        model = getattr(t.model, "module", t.model)
        if self.step is None or hasattr(model, "parts"):  # the DCGAN's update: no single-loss step to time
            return {FAMILY: r}
        params = list(model.parameters())
        _model_state(r, held(params, t.optimizer), 0, sum(p.numel() for p in params), dist.world_size,
                     params[0].element_size())
        ms = self._timed(t, data, config, dist)
        r.step_ms, r.no_sync_step_ms, exposed = ms["step"], ms["no_sync"], ms["step"] - ms["no_sync"]
        return {FAMILY: r, "measured": Measured(
            exposed_comm_ms=exposed, exposed_over_allreduce=exposed / ms["allreduce"],
            allreduce_all_grads_ms=ms["allreduce"], allreduce_4B_ms=ms["allreduce_4B"])}

    def _timed(self, t, data, config, dist) -> dict[str, float]:
        """Median ms of a step, the same step with no all-reduce (no_sync), one standalone all-reduce of every
        gradient at once and one of 4 bytes (the latency: the cost model's alpha), timed interleaved, round
        by round, with the loop's clock, so that drift of the machine's speed hits all four alike; on fresh
        batches after the run's own."""
        flat = torch.zeros(sum(p.numel() for p in t.model.parameters()), device=t.device)  # (all grads,)
        tiny = torch.zeros(1, device=t.device)
        timer = StepTimer(synchronizer(t.device))
        work = {"step": lambda b: self.step(t, b), "no_sync": lambda b: self.step(t, b, sync=False),
                "allreduce": lambda b: td.all_reduce(flat), "allreduce_4B": lambda b: td.all_reduce(tiny)}
        times: dict[str, list[float]] = {k: [] for k in work}
        first, spent = config.warmup + config.steps, 0.0
        for i in range(1 + max(10, config.steps)):  # the first round is warm-up
            batch = data.batch(first + i, dist.rank, dist.world_size)
            for kind, run in work.items():
                with timer:
                    run(batch)
                spent += timer.elapsed
                if i:
                    times[kind].append(timer.elapsed)
            if i and _enough(spent, t.device):  # at a real size on CPUs a round is two steps of seconds
                break
        return {k: summarize(v)["p50_ms"] for k, v in times.items()}

    def comm_bytes_predicted(self, model, config) -> float:
        """Every gradient all-reduced once with a ring; half the bytes in bf16."""
        full = allreduce_every_gradient(model, config)
        return full / 2 if self._option(config, "compress", "") else full

    def predict_step_ms(self, cal, config, row) -> float | None:
        return predict_data_parallel_ms(cal, config, self._option(config, "accum", 1))


def _enough(spent: float, device) -> bool:
    """The extras' time is spent (EXTRAS_BUDGET_S): every rank stops after the same round, as rank 0 says."""
    done = torch.tensor([float(spent > EXTRAS_BUDGET_S)], device=device)
    td.broadcast(done, 0)
    return bool(done.item())


def ddp_bucket_bytes(wrappers) -> list[int]:
    """Bytes of each bucket DDP all-reduces, as its logging data last says: rebuilt after the first step in
    the order backward produced the gradients (its first bucket then capped at 1 MiB), across `wrappers`."""
    out = []
    for w in wrappers:
        d = w._get_ddp_logging_data()
        sizes = str(d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or "")
        out += [int(b) for b in sizes.split(",") if b.strip()]
    return out


def _rounds(config) -> int:
    return max(3, min(10, config.steps))


class Zero(measure.Family):
    """ZeRO-1 and -2 by hand (zero): every rank all the parameters, flat, in buckets each padded to N chunks,
    and the optimizer state (stage 2: the gradients too) of its chunk of each. Lent: `held(t)`, this rank's
    (parameters, gradients, optimizer state) bytes; `buckets(t)`, each bucket's bytes; `options(config)`,
    its `zero_stage`. Each collective is timed alone on the flat parameters."""

    name = FAMILY

    def __init__(self, held, buckets, options):
        self.held, self.buckets, self.options = held, buckets, options

    def extra_measurements(self, t, data, config, dist, run) -> dict:
        r, e = Result(bucket_bytes=self.buckets(t)), element_bytes(config.precision)
        flat = sum(r.bucket_bytes) // e  # the parameters' elements, each bucket padded
        _model_state(r, self.held(t), self.options(config).zero_stage, flat, dist.world_size, e)
        return _sent(r, run, measured=measured_collectives(t.device, flat, rounds=_rounds(config)))

    def comm_bytes_predicted(self, model, config) -> float:
        """Reduce-scatter and all-gather of every parameter's worth, ring: 2(N-1)/N x P bytes (2 Psi)."""
        n = config.world_size
        padded = math.ceil(sum(p.numel() for p in model.parameters() if p.requires_grad) / n) * n
        e = element_bytes(config.precision)
        return wire_bytes("reduce_scatter", padded * e, n) + wire_bytes("all_gather", padded * e, n)

    def predict_step_ms(self, cal, config, row) -> float | None:
        """Each rank's share of the compute, then the reduce-scatter and the all-gather."""
        return predict_sharded_ms(cal, config, row, all_gathers=1)


class ZeroRedundancy(measure.Family):
    """torch's ZeroRedundancyOptimizer with DDP (zero_optimizer): every rank all the parameters and
    gradients, and the optimizer state (its wrapped optimizer's, `t.optimizer.optim`) of the whole
    parameters it owns. Lent: `owned(t, rank)`, the parameters `rank` owns."""

    name = FAMILY

    def __init__(self, owned):
        self.owned = owned

    def extra_measurements(self, t, data, config, dist, run) -> dict:
        params = list(t.model.parameters())
        r = Result(owned_param_bytes_per_rank=[param_bytes(self.owned(t, k)) for k in range(dist.world_size)])
        full, e = param_bytes(params), element_bytes(config.precision)
        mine = (full, full, optimizer_state_bytes(self.owned(t, dist.rank), t.optimizer.optim))
        _model_state(r, mine, 1, full // e, dist.world_size, e)  # the paper's stage 1: an even share
        return _sent(r, run)

    def comm_bytes_predicted(self, model, config) -> float:
        """DDP's all-reduce (2(N-1)/N x P) + the parameters broadcast from their owners ((N-1)/N x P)."""
        n, p = config.world_size, sum(tensor_bytes(q) for q in model.parameters())
        return wire_bytes("all_reduce", p, n) + wire_bytes("all_gather", p, n)  # a broadcast each: (N-1)/N

    def predict_step_ms(self, cal, config, row) -> float | None:
        """DDP's step (its all-reduce, predict_data_parallel_ms), then the broadcasts: (N-1)/N of the
        parameters, half an all-reduce's traffic, after the step (nothing to hide behind)."""
        ddp = predict_data_parallel_ms(cal, config, accum=1)
        return None if ddp is None else ddp + cal.allreduce_ms(cal.grad_bytes, config.world_size) / 2


class FullyShard(measure.Family):
    """FSDP2 (fsdp): every parameter, gradient and optimizer state sharded over the ranks of a replica.
    Lent: `groups(t)`, its FSDP groups, the root last; `dims(config, dist)`, its layout (the batch share
    of this rank); `options(config)`: `reshard` (1: parameters gathered again for backward), `mixed_precision`
    (bf16: gathered in bf16), `replicate` (HSDP: R replicas of N/R shards). After the run, one more step
    (untimed) samples the gathered parameters held at every operation; each collective is timed alone."""

    name = FAMILY

    def __init__(self, groups, dims, options):
        self.groups, self.dims, self.options = groups, dims, options

    def extra_measurements(self, t, data, config, dist, run) -> dict:
        mine = held(t.model.parameters(), t.optimizer)  # before the step below drops the gradients
        peak = _UnshardedPeak(_gathered_buffers(self.groups(t)))
        x, y = (b.to(t.device) for b in data.batch(0, *self.dims(config, dist).batch_share(dist.rank)))
        with peak:
            t.optimizer.zero_grad(set_to_none=True)
            t.loss_fn(call(t.model, x, y), y).backward()
        names = {id(m): n for n, m in t.model.named_modules()}
        r = Result(unsharded_peak_bytes_per_rank=every_rank(peak.peak),
                   fsdp_groups=[names.get(id(g)) or "(root)" for g in self.groups(t)])
        n = dist.world_size // self.options(config).replicate  # the ranks one copy is sharded over
        e, numel = element_bytes(config.precision), sum(math.prod(p.shape) for p in t.model.parameters())  # global
        _model_state(r, mine, 3, numel, n, e)
        return _sent(r, run, measured=measured_collectives(t.device, numel * e // 4, rounds=_rounds(config)))

    def comm_bytes_predicted(self, model, config) -> float:
        """All-gathers (two with reshard, one without) and one reduce-scatter, each (N-1)/N of the parameters'
        bytes; the all-gathers in bf16 under --mixed-precision bf16. (FSDP2 pads each parameter's first
        dimension to a multiple of N: a few rows more on the wire.)"""
        o = self.options(config)
        n, r = config.world_size // o.replicate, o.replicate  # shards per replica, replicas
        p = sum(q.numel() for q in model.parameters()) * element_bytes(config.precision)
        gathered = p / 2 if o.mixed_precision else p
        gathers = (2 if o.reshard else 1) * wire_bytes("all_gather", gathered, n)
        # HSDP: each rank's reduced shard is then all-reduced across the replicas
        return gathers + wire_bytes("reduce_scatter", p, n) + wire_bytes("all_reduce", p / n, r)

    def predict_step_ms(self, cal, config, row) -> float | None:
        """Each rank's share of the compute, the reduce-scatter and one all-gather (two with --reshard 1)
        (fp32 collectives: bf16 all-gathers take less; no HSDP term)."""
        return predict_sharded_ms(cal, config, row, all_gathers=1 + self.options(config).reshard)


class _UnshardedPeak(TorchDispatchMode):
    """The largest sum of gathered (unsharded) parameter bytes held at any operation of a step."""

    def __init__(self, buffers):
        super().__init__()
        self.buffers, self.peak = buffers, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.peak = max(self.peak, sum(b.untyped_storage().nbytes() for b in self.buffers))
        return func(*args, **(kwargs or {}))


def _gathered_buffers(groups) -> list[torch.Tensor]:
    """Where FSDP2 puts each parameter's all-gathered (whole) copy: allocated while unsharded, storage
    freed on reshard (FSDPParam.all_gather_outputs, torch 2.13; created at the first all-gather)."""
    return [b for g in groups for group in [g._get_fsdp_state()._fsdp_param_group] if group is not None
            for p in group.fsdp_params for b in p.all_gather_outputs]


# The report: model state and bytes by collective ------------------------------------------------------------


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send")


def rows(all_rows: list) -> list:
    """The rows with a ZeRO stage (zero, zero_optimizer, fsdp, and ddp, the unsharded reference), when a
    sharded one is among them."""
    chosen = [r for r in all_rows if (found := result(r)) is not None and found.zero_stage is not None]
    return chosen if any(result(r).zero_stage for r in chosen) else []


def sent_by_collective(r) -> dict[str, float]:
    """A row's bytes per step by collective (the loop's count, kept in its details by the families that
    show it), or its whole count as an all-reduce's."""
    return r.details.get("bytes_per_step_by_collective") or (
        {"all_reduce": r.comm_bytes_per_step} if r.comm_bytes_per_step else {})


def _largest(v):
    """A per-rank list's largest entry (ranks that did not measure give None), or None."""
    v = [x for x in v or [] if x is not None]
    return max(v) if v else None


def tables(all_rows: list) -> list:
    """Model state per rank by kind beside the ZeRO paper's formula, and bytes per step by collective."""
    chosen = rows(all_rows)
    if not chosen:
        return []
    state = table("Sharded data parallel: model state per rank (the largest rank)",
                  [("strategy", "left"), ("params", "right"), ("grads", "right"), ("optimizer", "right"),
                   ("model state", "right"), ("ZeRO formula", "right"), ("gathered peak", "right")])
    kinds = [k for k in COLLECTIVES if any(sent_by_collective(r).get(k) for r in chosen)]
    sent = table("... and bytes each rank sends per step, by collective",
                 [("strategy", "left"), *((k.replace("_", "-"), "right") for k in kinds), ("total", "right"),
                  ("textbook", "right")])
    for r in chosen:
        s = result(r)
        state.add_row(r.label, *(size(_largest(v)) for v in (s.param_bytes_per_rank, s.grad_bytes_per_rank,
                                                              s.optimizer_state_bytes_per_rank)),
                      size(_largest(r.details.get("model_state_bytes_per_device"))), size(s.zero_formula_bytes),
                      size(_largest(s.unsharded_peak_bytes_per_rank)))
        by = sent_by_collective(r)
        sent.add_row(r.label, *(size(by.get(k)) if by.get(k) else "-" for k in kinds),
                     size(r.comm_bytes_per_step), size(r.comm_bytes_predicted))
    return [state, sent]


def notes(all_rows: list) -> list[str]:
    """What a reduce-scatter costs against an all-reduce, as a sharded strategy's ranks timed them in this
    run: the reason ZeRO and FSDP are slow on CPU, in numbers."""
    timed = [r for r in all_rows if r.measured.reduce_scatter_all_grads_ms and r.measured.allreduce_all_grads_ms]
    if not timed:
        return []
    r, m = timed[0], timed[0].measured
    ratio = m.reduce_scatter_all_grads_ms / m.allreduce_all_grads_ms
    line = (f"reduce-scatter vs all-reduce, timed by {r.label}'s ranks: {m.reduce_scatter_all_grads_ms:.1f} ms "
            f"against {m.allreduce_all_grads_ms:.1f} ms for every gradient ({ratio:.2f}x; all-gather "
            f"{m.all_gather_all_params_ms:.1f} ms)")
    if r.device_kind in ("virtual", "shared"):  # gloo either way
        return [line + ", though a ring reduce-scatter sends half an all-reduce's bytes: gloo reduce-scatters by "
                "all-reducing and keeping a chunk (PR #118911), so on CPU the sharded strategies pay more time "
                "than DDP for their memory saving. On NCCL a reduce-scatter moves half the bytes and takes about "
                "half the time: there the saving is real."]
    return [line + "; a ring reduce-scatter sends half an all-reduce's bytes (about 0.5x expected)."]


def _per_rank(value, ranks: int) -> list:
    return (value or []) + [None] * (ranks - len(value or []))


def memory(all_rows: list) -> str | None:
    """Model state each rank holds, stacked params / grads / optimizer state, with the ZeRO formula's
    figure for the strategy as a diamond."""
    bars = []  # (label, {kind: bytes}, formula bytes or None)
    for r in rows(all_rows):
        s = result(r)
        for k in range(r.world_size):
            parts = {kind: _per_rank(v, r.world_size)[k] for kind, v in (
                ("params", s.param_bytes_per_rank), ("grads", s.grad_bytes_per_rank),
                ("optimizer", s.optimizer_state_bytes_per_rank))}
            if any(v is not None for v in parts.values()):
                bars.append((f"{r.label} rank {k}", parts, s.zero_formula_bytes))
    return charts.stacked(bars)


def collectives(all_rows: list) -> str | None:
    """Bytes one rank sends per step, stacked by collective, for every row that sends any."""
    shown = [(r, sent_by_collective(r)) for r in all_rows if r.status == "ok"]
    shown = [(r, by) for r, by in shown if by and any(by.values())]
    if not shown:
        return None
    plt = charts.plt()
    kinds = list(dict.fromkeys(k for _, by in shown for k in by))
    colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, ax = plt.subplots(figsize=(7.5, charts.height(len(shown))))
    seen = set()
    for i, (r, by) in enumerate(shown):
        left = 0.0
        for k in kinds:
            if by.get(k):
                ax.barh(i, charts.mib(by[k]) * 1024, left=left, color=colors[k], label=None if k in seen else k)
                seen.add(k)
                left += charts.mib(by[k]) * 1024
        if r.comm_bytes_predicted:
            ax.plot(charts.mib(r.comm_bytes_predicted) * 1024, i, marker="|", color="black", ms=12,
                    label=None if "textbook" in seen else "textbook")
            seen.add("textbook")
    ax.set_yticks(range(len(shown)), [r.label for r, _ in shown])
    ax.invert_yaxis()
    ax.set_xlabel("KiB sent per rank per step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return charts.svg(fig)
