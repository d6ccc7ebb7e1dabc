"""The sharded family: data parallel, whole and sharded. Every rank (or replica) the whole model and every
gradient averaged (single, manual_dp, data_parallel in one process: `Replicas`; ddp, manual_ddp: one
all-reduce of every gradient, `AllReduce`), or the model state sharded by the ZeRO paper's stages (zero:
stages 1-2 by hand, `Zero`; zero_optimizer: torch's ZeroRedundancyOptimizer, `ZeroRedundancy`; fsdp: FSDP2,
stage 3, `FullyShard`). What each rank holds by kind beside the paper's formula, the bytes by collective,
ddp's exposed communication, the textbook bytes and the cost model's step; the report's tables, note and
pictures of them. The strategies lend what the measurement needs (see each family's docstring):

    MEASURE = sharded.FullyShard(groups, dims)      # fsdp
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel import measure
from parallel.kit.collectives import every_rank
from parallel.kit.tensors import optimizer_state_bytes, param_bytes, tensor_bytes
from parallel.loop.master import MASTER
from parallel.loop.optim import moments
from parallel.measure.formulas import element_bytes, run_state, wire_bytes
from parallel.measure.sharded_cost import measured_collectives, predict_data_parallel_ms, predict_sharded_ms
from parallel.models.outputs import call

FAMILY = "sharded"


@dataclass
class Result:
    """What a data-parallel row measured beyond its time and bytes (details["sharded"]). The model state by
    kind is every rank's, in rank order."""

    FAMILY: ClassVar[str] = FAMILY
    zero_stage: int | None = None  # the ZeRO stage its model state follows (0: ddp, the unsharded reference of
    #   the sharded table); None: not in that table
    param_bytes_per_rank: list[int] | None = None
    grad_bytes_per_rank: list[int] | None = None
    optimizer_state_bytes_per_rank: list[int] | None = None  # its moments (the masters apart)
    master_bytes_per_rank: list[int] | None = None  # bf16-master: the fp32 master weights (loop/master.py)
    zero_formula_bytes: float | None = None  # the paper's model state per rank, K from the run's optimiser
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


# The families --------------------------------------------------------------------------------------------


def held(params, optimizer) -> tuple[int, int, int, int]:
    """Bytes of the parameters, their gradients, their fp32 masters (bf16-master) and the optimizer's other
    state (its moments) that this rank holds (a DTensor's local shard)."""
    params = list(params)
    masters = master_bytes(params, optimizer)
    return (param_bytes(params), sum(tensor_bytes(p.grad) for p in params if p.grad is not None), masters,
            optimizer_state_bytes(params, optimizer) - masters)


def master_bytes(params, optimizer) -> int:
    """The fp32 master weights the optimiser keeps for `params` (loop/master.py; none outside bf16-master)."""
    return sum(tensor_bytes(m) for p in params if (m := optimizer.state.get(p, {}).get(MASTER)) is not None)


def _model_state(r: Result, mine: tuple[int, int, int, int], stage: int, numel: int, shards: int, element: int,
                 k: float, master: int = 0) -> None:
    """Every rank's (parameters, gradients, masters, moments) bytes into `r` (a collective), beside the ZeRO
    paper's model state per rank for `numel` parameters at `stage` over `shards` ranks (formulas.run_state,
    K from the run's optimiser: fp32 SGD with momentum K = 4, DDP 12 Psi, stage 1 4 + 4 + 4/N, 2: 4 + (4 +
    4)/N, 3: 12/N; fp32 AdamW K = 8, DDP 16 Psi, stage 1 4 + 4 + 8/N, 2: 4 + 12/N, 3: 16/N; bf16-master
    AdamW: the paper's 2 + 2 + 12, K = 4 + 8, `master` 4 bytes a parameter)."""
    params, grads, masters, optimizer = zip(*every_rank(mine), strict=True)
    r.param_bytes_per_rank, r.grad_bytes_per_rank, r.optimizer_state_bytes_per_rank = (
        list(params), list(grads), list(optimizer))
    r.master_bytes_per_rank = list(masters) if any(masters) else None
    r.zero_stage, r.zero_formula_bytes = stage, run_state(numel, stage, shards, element, k, master)


def master_of(run) -> int:
    """Bytes of a parameter's master weight: fp32's 4 under bf16-master, else none."""
    return 4 if run.precision == "bf16-master" else 0


def _sent(r: Result, result, **measured) -> dict:
    """A sharded row's details: its Result, and the loop's bytes by collective beside it, where the report's
    picture of them reads them for every family (ddp's are shown as one all-reduce, its whole count: its
    first step's broadcast of the rebuilt buckets' order, 24 bytes, is no collective of the algorithm)."""
    return {FAMILY: r, "bytes_per_step_by_collective": result.wire.per_step(), **measured}


def _rounds(run) -> int:
    return max(3, min(10, run.steps))


class Zero(measure.Family):
    """ZeRO-1 and -2 by hand (zero): every rank all the parameters, flat, in buckets each padded to N chunks,
    and the optimizer state (stage 2: the gradients too) of its chunk of each. Lent: `held(t)`, this rank's
    (parameters, gradients, optimizer state) bytes; `buckets(t)`, each bucket's bytes; `run.options`,
    its `zero_stage`. Each collective is timed alone on the flat parameters."""


    def __init__(self, held, buckets):
        self.held, self.buckets = held, buckets

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        r, e = Result(bucket_bytes=self.buckets(t)), element_bytes(run.precision)
        flat = sum(r.bucket_bytes) // e  # the parameters' elements, each bucket padded
        k = moments(run, t.model.parameters())  # buffers a parameter: the optimiser's
        _model_state(r, self.held(t), run.options.zero_stage, flat, dist.world_size, e, k, master_of(run))
        return _sent(r, result, measured=measured_collectives(t.device, flat, rounds=_rounds(run)))

    def comm_bytes_predicted(self, model, run) -> float:
        """Reduce-scatter and all-gather of every parameter's worth, ring: 2(N-1)/N x P bytes (2 Psi)."""
        n = run.world_size
        padded = math.ceil(sum(p.numel() for p in model.parameters() if p.requires_grad) / n) * n
        e = element_bytes(run.precision)
        return wire_bytes("reduce_scatter", padded * e, n) + wire_bytes("all_gather", padded * e, n)

    def predict_step_ms(self, cal, run, row) -> float | None:
        """Each rank's share of the compute, then the reduce-scatter and the all-gather."""
        return predict_sharded_ms(cal, run, row, all_gathers=1)


class ZeroRedundancy(measure.Family):
    """torch's ZeroRedundancyOptimizer with DDP (zero_optimizer): every rank all the parameters and
    gradients, and the optimizer state (its wrapped optimizer's, `t.optimizer.optim`) of the whole
    parameters it owns. Lent: `owned(t, rank)`, the parameters `rank` owns."""


    def __init__(self, owned):
        self.owned = owned

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        params = list(t.model.parameters())
        r = Result(owned_param_bytes_per_rank=[param_bytes(self.owned(t, k)) for k in range(dist.world_size)])
        full, e = param_bytes(params), element_bytes(run.precision)
        owned = self.owned(t, dist.rank)
        masters = master_bytes(owned, t.optimizer.optim)
        mine = (full, full, masters, optimizer_state_bytes(owned, t.optimizer.optim) - masters)
        # the paper's stage 1: an even share
        _model_state(r, mine, 1, full // e, dist.world_size, e, moments(run, params), master_of(run))
        return _sent(r, result)

    def comm_bytes_predicted(self, model, run) -> float:
        """DDP's all-reduce (2(N-1)/N x P) + the parameters broadcast from their owners ((N-1)/N x P)."""
        n, p = run.world_size, sum(tensor_bytes(q) for q in model.parameters())
        return wire_bytes("all_reduce", p, n) + wire_bytes("all_gather", p, n)  # a broadcast each: (N-1)/N

    def predict_step_ms(self, cal, run, row) -> float | None:
        """DDP's step (its all-reduce, predict_data_parallel_ms), then the broadcasts: (N-1)/N of the
        parameters, half an all-reduce's traffic, after the step (nothing to hide behind)."""
        ddp = predict_data_parallel_ms(cal, run, accum=1)
        return None if ddp is None else ddp + cal.allreduce_ms(cal.grad_bytes, run.world_size) / 2


class FullyShard(measure.Family):
    """FSDP2 (fsdp): every parameter, gradient and optimizer state sharded over the ranks of a replica.
    Lent: `groups(t)`, its FSDP groups, the root last; `dims(config, dist)`, its layout (the batch share
    of this rank); `run.options`: `reshard` (1: parameters gathered again for backward), `mixed_precision`
    (bf16: gathered in bf16), `replicate` (HSDP: R replicas of N/R shards). After the run, one more step
    (untimed, on two samples) samples the gathered parameters held at every operation; each collective is
    timed alone."""


    def __init__(self, groups, dims):
        self.groups, self.dims = groups, dims

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        mine = held(t.model.parameters(), t.optimizer)  # before the step below drops the gradients
        peak = _UnshardedPeak(_gathered_buffers(self.groups(t)))
        # two of its samples: what is gathered does not grow with the batch, and a whole share's step at
        # GPT-2 small's shape on CPUs took 5 s under the dispatch mode that watches it
        x, y = (b[:2].to(t.device) for b in data.batch(0, *self.dims(run, dist).batch_share(dist.rank)))
        with peak:
            t.optimizer.zero_grad(set_to_none=True)
            t.loss_fn(call(t.model, x, y), y).backward()
        names = {id(m): n for n, m in t.model.named_modules()}
        r = Result(unsharded_peak_bytes_per_rank=every_rank(peak.peak),
                   fsdp_groups=[names.get(id(g)) or "(root)" for g in self.groups(t)])
        n = dist.world_size // run.options.replicate  # the ranks one copy is sharded over
        e, numel = element_bytes(run.precision), sum(math.prod(p.shape) for p in t.model.parameters())  # global
        _model_state(r, mine, 3, numel, n, e, moments(run, t.model.parameters()), master_of(run))
        return _sent(r, result, measured=measured_collectives(t.device, numel * e // 4, rounds=_rounds(run)))

    def comm_bytes_predicted(self, model, run) -> float:
        """All-gathers (two with reshard, one without) and one reduce-scatter, each (N-1)/N of the parameters'
        bytes; the all-gathers in bf16 under --mixed-precision bf16. (FSDP2 pads each parameter's first
        dimension to a multiple of N: a few rows more on the wire.)"""
        o = run.options
        n, r = run.world_size // o.replicate, o.replicate  # shards per replica, replicas
        p = sum(q.numel() for q in model.parameters()) * element_bytes(run.precision)
        gathered = p / 2 if o.mixed_precision else p
        gathers = (2 if o.reshard else 1) * wire_bytes("all_gather", gathered, n)
        # HSDP: each rank's reduced shard is then all-reduced across the replicas
        return gathers + wire_bytes("reduce_scatter", p, n) + wire_bytes("all_reduce", p / n, r)

    def predict_step_ms(self, cal, run, row) -> float | None:
        """Each rank's share of the compute, the reduce-scatter and one all-gather (two with --reshard 1)
        (fp32 collectives: bf16 all-gathers take less; no HSDP term)."""
        return predict_sharded_ms(cal, run, row, all_gathers=1 + run.options.reshard)


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


