"""The data-parallel replicas of the sharded family: every rank (or replica) holds the whole model and every
gradient is averaged. `Replicas`: single, manual_dp, data_parallel in one process; `AllReduce`: ddp and
manual_ddp, one all-reduce of every gradient (ddp's exposed communication timed against the same step
without it). Their rows use the sharded family's Result (measure/sharded.py)."""

from __future__ import annotations

import functools
import math

import torch
import torch.distributed as td

from parallel import measure
from parallel.loop.optim import moments
from parallel.loop.results import Measured
from parallel.measure.formulas import element_bytes
from parallel.measure.sharded import FAMILY, Result, _model_state, held, master_of
from parallel.measure.sharded_cost import (
    allreduce_every_gradient,
    grad_bytes,
    predict_data_parallel_ms,
    timed_rounds,
)

EXTRAS_BUDGET_S = 10.0  # seconds ddp's interleaved rounds may take: all 10 on small models, 1 at real sizes


class Replicas(measure.Family):
    """Data parallel inside one process (single: one replica; manual_dp by hand; data_parallel, torch's
    nn.DataParallel): every step the parameters copied out to each of the n devices, each computing its
    chunk of the batch, the gradients copied back to the first. Lent: `world_size(config)`, n (1 for
    `single`, and for data_parallel's pass-through on CPU); `phases(t)`, the PhaseTimer of its step
    (manual_dp); `copies`: the copies are seen by the loop's counter, so the textbook's bytes are set
    beside them (not nn.DataParallel's, made inside torch)."""


    def __init__(self, world_size=None, phases=None, copies: bool = True):
        self.world_size, self.phases, self.copies = world_size or (lambda run: run.world_size), phases, copies

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        if self.phases is None:
            return {}
        return {FAMILY: Result(step_phases_ms=self.phases(t).medians(skip=run.warmup))}  # the timed steps'

    def comm_bytes_predicted(self, model, run) -> float | None:
        """Bytes between the first device and the others per step: parameters out and gradients back
        (2 x params x (N-1)); inputs out, outputs back and their gradients out ((N-1)/N of each), fp32
        (fp64 under --precision fp64)."""
        if not self.copies:
            return None
        n = self.world_size(run)
        if n == 1:
            return 0  # one device: nothing to send
        workload, e = run.workload, element_bytes(run.precision)
        x_bytes = run.batch_size * e * math.prod(workload.input_shape)
        out_bytes = run.batch_size * e * workload.classes
        return 2 * (n - 1) * grad_bytes(model) + (n - 1) / n * (x_bytes + 2 * out_bytes)

    def predict_step_ms(self, cal, run, row) -> float:
        """Replicas compute their chunks in parallel; the parameters are copied out and the gradients back."""
        n = self.world_size(run)
        copies = cal.copy_ms(2 * (n - 1) * cal.grad_bytes) if n > 1 else 0
        return cal.compute_ms(-(-run.batch_size // n)) + copies


class AllReduce(measure.Family):
    """Every rank the whole model, every gradient all-reduced once a step (ddp, manual_ddp). Lent:
    `buckets(t)`, each bucket's bytes; the run's options (ddp's `accum`: micro-batches
    a step, `compress`: bf16 all-reduces); `step(t, batch, sync)`, one optimiser step, without its
    all-reduce where not `sync` (ddp): with it the row times its exposed communication (the step time minus
    the same step with no all-reduce, beside one all-reduce of every gradient) and is the sharded table's
    unsharded reference, ZeRO stage 0."""


    def __init__(self, buckets, step=None):
        self.buckets, self.step = buckets, step

    def _option(self, run, name: str, default):
        return getattr(run.options, name, default)  # the strategy's own, where it has the option

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        calls = result.wire.per_step("calls")
        r = Result(bucket_bytes=self.buckets(t), all_reduces_per_step=calls.get("all_reduce", 0.0))
        model = getattr(t.model, "module", t.model)
        if self.step is None or hasattr(model, "parts"):  # the DCGAN's update: no single-loss step to time
            return {FAMILY: r}
        params = list(model.parameters())
        _model_state(r, held(params, t.optimizer), 0, sum(p.numel() for p in params), dist.world_size,
                     params[0].element_size(), moments(run, params), master_of(run))
        ms = self._timed(t, data, run, dist)
        r.step_ms, r.no_sync_step_ms, exposed = ms["step"], ms["no_sync"], ms["step"] - ms["no_sync"]
        return {FAMILY: r, "measured": Measured(
            exposed_comm_ms=exposed, exposed_over_allreduce=exposed / ms["allreduce"],
            allreduce_all_grads_ms=ms["allreduce"], allreduce_4B_ms=ms["allreduce_4B"])}

    def _timed(self, t, data, run, dist) -> dict[str, float]:
        """Median ms of a step, the same step with no all-reduce (no_sync), one standalone all-reduce of every
        gradient at once and one of 4 bytes (the latency: the cost model's alpha), timed interleaved, round
        by round, with the loop's clock (timed_rounds, within EXTRAS_BUDGET_S: at GPT-2 small's shape on
        CPUs a round is two steps of 5 s, and one round is all); on fresh batches after the run's own."""
        flat = torch.zeros(sum(p.numel() for p in t.model.parameters()), device=t.device)  # (all grads,)
        tiny = torch.zeros(1, device=t.device)
        first = run.warmup + run.steps
        batch = functools.lru_cache(maxsize=1)(lambda i: data.batch(first + i, dist.rank, dist.world_size))  # a round's
        work = {"step": lambda i: self.step(t, batch(i)), "no_sync": lambda i: self.step(t, batch(i), sync=False),
                "allreduce": lambda i: td.all_reduce(flat), "allreduce_4B": lambda i: td.all_reduce(tiny)}
        return timed_rounds(work, max(10, run.steps), EXTRAS_BUDGET_S, t.device)

    def comm_bytes_predicted(self, model, run) -> float:
        """Every gradient all-reduced once with a ring; half the bytes in bf16."""
        full = allreduce_every_gradient(model, run)
        return full / 2 if self._option(run, "compress", "") else full

    def predict_step_ms(self, cal, run, row) -> float | None:
        return predict_data_parallel_ms(cal, run, self._option(run, "accum", 1))


def ddp_bucket_bytes(wrappers) -> list[int]:
    """Bytes of each bucket DDP all-reduces, as its logging data last says: rebuilt after the first step in
    the order backward produced the gradients (its first bucket then capped at 1 MiB), across `wrappers`."""
    out = []
    for w in wrappers:
        d = w._get_ddp_logging_data()
        sizes = str(d.get("rebuilt_bucket_sizes") or d.get("bucket_sizes") or "")
        out += [int(b) for b in sizes.split(",") if b.strip()]
    return out


class Workers(measure.Family):
    """Hogwild's workers, each training its share of the batch on one model in shared memory: nothing is
    sent (they write the same pages), a step is one worker's share computed. Lent: `world_size(run)`, the
    workers, and `summary(t)`, what they saw (staleness, wall time, memory)."""

    def __init__(self, world_size, summary):
        self.world_size, self.summary = world_size, summary

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        return self.summary(t)

    def comm_bytes_predicted(self, model, run) -> int:
        return 0  # shared memory: no messages

    def predict_step_ms(self, cal, run, row) -> float:
        return cal.compute_ms(run.batch_size // self.world_size(run))  # a worker's step; no communication
