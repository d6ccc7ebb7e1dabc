"""Step timing that is right on CPU and GPU alike.

CUDA runs kernels asynchronously: a clock read without a synchronize measures only how long it took to
*queue* the work. So the device is synchronized before *every* clock read (both ends of a step), the
warm-up steps are excluded by the loop, and the summary is the median and p95, not a mean that one
stall can move.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

# Set by the harness when it starts a child (launch/child.run_child): the wall-clock time it did, from
# which the child reads how long its start-up took (the `start` of a row's phases_s)
LAUNCHED_AT = "PARALLEL_LAUNCHED_AT"


class StepTimer:
    """`with timer: step()` -> `timer.elapsed` seconds, the device synchronized before each clock read."""

    def __init__(self, synchronize: Callable[[], None], clock: Callable[[], float] = time.perf_counter):
        self.synchronize, self.clock = synchronize, clock
        self.started = self.elapsed = float("nan")

    def __enter__(self) -> StepTimer:
        self.synchronize()  # work queued before the step must not be billed to it
        self.started = self.clock()
        return self

    def __exit__(self, *exc) -> None:
        self.synchronize()  # the step's own kernels must have finished
        self.elapsed = self.clock() - self.started


class PhaseTimer:
    """`with phases("scatter"): ...` times each phase of a step and labels it for the profiler, on an
    IntervalClock (devices.py): host clock reads on CPU, CUDA events on GPUs, so that timing the phases
    does not stop the host between them. `start_step()` and `end_step()` bracket each step;
    `medians(skip)` -> {"scatter_ms": ...} over all but the first `skip` steps."""

    def __init__(self, clock):
        self.clock = clock
        self.times: dict[str, list[float]] = defaultdict(list)
        self._open: list[tuple] = []

    def start_step(self) -> None:
        self.clock.start_step()

    @contextlib.contextmanager
    def __call__(self, name: str):
        from torch.autograd.profiler import record_function

        with record_function(name):
            start = self.clock.stamp()
            yield
            self._open.append((name, start, self.clock.stamp()))

    def end_step(self) -> None:
        self.clock.end_step()
        for name, start, end in self._open:
            self.times[name].append(self.clock.seconds(end) - self.clock.seconds(start, first=True))
        self._open = []

    def medians(self, skip: int = 0) -> dict[str, float]:
        return {f"{k}_ms": summarize(v[skip:])["p50_ms"] for k, v in self.times.items() if v[skip:]}


def median_time(fn: Callable[[], object], reps: int, synchronize: Callable[[], None],
                budget_s: float | None = None) -> float:
    """Median seconds of `reps` runs of fn, synchronized before each clock read, after one warm-up run
    (timed like the others, then dropped). `budget_s`: fewer runs where `reps` of the warm-up's length
    would take longer, at least 3, or none where the warm-up alone took longer than the budget (a step of
    seconds, at a real size on a CPU): then the warm-up's own time is the answer, since a run of seconds
    is warm from the first (within 2% at GPT-2 small's shape, docs/measurements.md). A measurement stays
    a small part of a run at any model size."""
    timer, times = StepTimer(synchronize), []
    with timer:
        fn()
    if budget_s is not None and timer.elapsed > budget_s:
        return timer.elapsed
    if budget_s is not None:
        reps = min(reps, max(3, int(budget_s / max(timer.elapsed, 1e-9))))
    for _ in range(reps):
        with timer:
            fn()
        times.append(timer.elapsed)
    return float(np.median(times))


def summarize(seconds: Sequence[float]) -> dict[str, float | None]:
    """Median, p95 and range in milliseconds; None for an empty list."""
    if not seconds:
        return {"p50_ms": None, "p95_ms": None, "min_ms": None, "max_ms": None, "n": 0}
    ms = np.asarray(seconds, dtype=float) * 1e3
    return {
        "p50_ms": float(np.median(ms)),
        "p95_ms": float(np.percentile(ms, 95)),
        "min_ms": float(ms.min()),
        "max_ms": float(ms.max()),
        "n": int(ms.size),
    }
