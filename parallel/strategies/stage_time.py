"""Time on a pipeline's stages: a schedule played out on given forward and backward times (`play`,
`simulate`: the theory beside a measurement, and the cost model's prediction), and measured (`Busy`: each
stage's busy intervals in a step; `timed_stage`: torch's PipelineStage with its pieces timed). The stages
themselves, how a model is cut into them and what they hold: stages.py.
"""

from __future__ import annotations

import contextlib
import statistics

import torch
from torch.autograd.profiler import record_function

from parallel.devices import IntervalClock
from parallel.results import Measured
from parallel.strategies.stages import ActivationMeter


def simulate(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> float:
    """How long a schedule takes (`play`'s last end). Unequal stages and unequal forward and backward
    times are what the (p-1)/(m+p-1) formula leaves out (GPipe's forward phase runs at the slowest
    forward, its backward phase at the slowest backward)."""
    return max(end for _, _, end, _, _ in play(ops, fwd, bwd, hop))


def play(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> list[tuple]:
    """A schedule played out: stage s runs ops[s] ("F" | "B", micro-batch) in order, each F taking fwd[s]
    and each B bwd[s]; F(s, j) also waits for F(s-1, j) and B(s, j) for B(s+1, j), plus `hop` for the
    transfer between stages. Returns every piece as (stage, start, end, kind, micro-batch)."""
    p, done, free, at, out = len(ops), {}, [0.0] * len(ops), [0] * len(ops), []
    left = sum(map(len, ops))
    while left:
        moved = False
        for s in range(p):
            while at[s] < len(ops[s]):
                kind, j = ops[s][at[s]]
                dep = ((s - 1, "F", j) if kind == "F" and s > 0 else
                       (s + 1, "B", j) if kind == "B" and s < p - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] + hop if dep is not None else 0.0)
                free[s] = done[(s, kind, j)] = start + (fwd[s] if kind == "F" else bwd[s])
                out.append((s, start, free[s], kind, j))
                at[s], left, moved = at[s] + 1, left - 1, True
        if not moved:
            raise ValueError("the schedule waits on itself")
    return out


class Busy:
    """Busy intervals of each stage within a step, on one clock per step: `busy.start_step()`, then
    `with busy(s, label): ...` around each piece of stage s's work, then `busy.end_step()`. The bubble is
    the mean fraction of the step's span during which a stage had nothing to do. The stamps come from an
    IntervalClock: host clock reads on CPU, CUDA events on GPUs (synchronizing around every interval
    would stop the host from queueing ahead and inflate the very bubble measured)."""

    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.clock = IntervalClock(devices)
        self.stamps: list[list[tuple]] = [[] for _ in devices]
        self.bubbles: list[float] = []
        self.busy_ms: list[list[float]] = []
        self.ends_ms: list[float] = []  # when the step's last piece of work ended, since the step started
        self._last: list = []  # the last step's intervals and stamps, per stage (`timeline`, after the run)

    def start_step(self) -> None:
        self.clock.start_step()

    @contextlib.contextmanager
    def __call__(self, s: int, label: str):
        with record_function(f"stage {s} {label}"):  # named in profiles
            start = self.clock.stamp([self.devices[s]])
            yield
            self.stamps[s].append((start, self.clock.stamp([self.devices[s]]), label))  # only stage s's thread appends

    def end_step(self) -> None:
        self.clock.end_step()
        intervals = [[(self.clock.seconds(a, first=True), self.clock.seconds(b)) for a, b, _ in stage]
                     for stage in self.stamps]
        self._last = list(zip(intervals, self.stamps, strict=True))  # kept as they are: the step is on the clock
        spans = [iv for stage in intervals for iv in stage]
        span = max(e for _, e in spans) - min(b for b, _ in spans)
        busy = [sum(e - b for b, e in stage) for stage in intervals]
        self.bubbles.append(sum(1 - b / span for b in busy) / len(busy))
        self.busy_ms.append([b * 1e3 for b in busy])
        self.ends_ms.append(max(e for _, e in spans) * 1e3)
        self.stamps = [[] for _ in self.stamps]

    @property
    def timeline(self) -> list[list[tuple]]:
        """The last step's (start ms, end ms, label) per stage, for report.html's schedule chart."""
        return [[(round(b * 1e3, 3), round(e * 1e3, 3), label) for (b, e), (_, _, label) in zip(stage, stamps,
                                                                                                strict=True)]
                for stage, stamps in self._last]

    def summary(self, skip: int, p: int, m: int) -> dict:
        theory = (p - 1) / (m + p - 1)
        if not self.bubbles:
            return {"measured": Measured(bubble_theory=theory)}
        kept = self.bubbles[skip:] or self.bubbles
        per_stage = list(zip(*(self.busy_ms[skip:] or self.busy_ms), strict=True))
        return {"measured": Measured(bubble_measured=statistics.median(kept), bubble_theory=theory),
                "stage_busy_ms": [round(statistics.median(s), 2) for s in per_stage], "stage_timeline": self.timeline}


def timed_stage(module, index, count, device, group, busy: Busy, meter: ActivationMeter):
    """torch's PipelineStage (pipeline_dist, fsdp_pp) with its forward and backward pieces timed on `busy`
    and the activations they keep for backward counted by `meter`: torch's schedules call these three
    methods of a stage. `stage.peak`: the most activation bytes it held at once."""
    from torch.distributed.pipelining import PipelineStage

    class Timed(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            before = meter.bytes
            with busy(0, f"stage {index} F{fwd_chunk_id}"), meter:
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            self.held[fwd_chunk_id] = meter.bytes - before
            self.peak = max(self.peak, sum(self.held.values()))
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with busy(0, f"stage {index} {'B' if full_backward else 'I'}{bwd_chunk_id}"):
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                 last_backward=last_backward)
            if full_backward:
                self.held.pop(bwd_chunk_id, None)
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with busy(0, f"stage {index} W{bwd_chunk_id}"):
                out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            self.held.pop(bwd_chunk_id, None)  # the weight gradient was the last to need them
            return out

    stage = Timed(module, index, count, device, group=group)
    stage.held, stage.peak, stage.meter = {}, 0, meter  # micro-batch -> activation bytes kept; the most at once
    return stage
