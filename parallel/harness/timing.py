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
    """`with phases("scatter"): ...` times each phase of a step like StepTimer (synchronized clocks) and
    labels it for the profiler. `medians(skip)` -> {"scatter_ms": ...} over all but the first `skip`."""

    def __init__(self, synchronize: Callable[[], None]):
        self.synchronize = synchronize
        self.times: dict[str, list[float]] = defaultdict(list)

    @contextlib.contextmanager
    def __call__(self, name: str):
        from torch.autograd.profiler import record_function

        with record_function(name), StepTimer(self.synchronize) as timer:
            yield
        self.times[name].append(timer.elapsed)

    def medians(self, skip: int = 0) -> dict[str, float]:
        return {f"{k}_ms": summarize(v[skip:])["p50_ms"] for k, v in self.times.items() if v[skip:]}


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
