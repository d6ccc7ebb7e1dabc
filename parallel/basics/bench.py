"""CPU vs GPU, timed right and timed naively, side by side.

    python -m parallel bench cpu-vs-gpu [--scale 1] [--repeats 10] [--out DIR]

CUDA kernels are *asynchronous*: a call returns as soon as the kernel is queued. A clock read around a
call without torch.cuda.synchronize() measures the queueing, not the work, which is how introductory
material comes to report GPU "speed-ups" of 1000x for a matrix product. Here every case is timed both
ways on each device, after the same warm-up:

    synced:  [sync] clock  fn()  [sync] clock     x repeats -> median and range   (parallel/timing.StepTimer)
    naive:          clock  fn()         clock     x repeats -> median              (what the material did)

On CPU the two agree (CPU ops finish before they return). So that the pitfall shows on any machine,
the table also times a simulated asynchronous device (`AsyncDevice`: work runs on a background thread,
like a GPU's queue) whose steps take a known time.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from parallel.basics import implausible
from parallel.loop.timing import StepTimer, summarize
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS
from parallel.world.devices import gpu_count, synchronizer


def time_synced(fn: Callable[[], object], synchronize: Callable[[], None], repeats: int, warmup: int = 2) -> dict:
    """Right: warm up, synchronize before both clock reads, `repeats` times; median and range in ms."""
    timer, times = StepTimer(synchronize), []
    for i in range(warmup + repeats):
        with timer:
            fn()
        if i >= warmup:
            times.append(timer.elapsed)
    return summarize(times)


def time_naive(fn: Callable[[], object], synchronize: Callable[[], None], repeats: int, warmup: int = 2) -> dict:
    """Wrong on a GPU: the same warm-up and repeats, but the clock never waits for the device. The queue
    is drained off the clock at the end only, so the caller's next measurement starts clean."""
    for _ in range(warmup):
        fn()
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    synchronize()
    return summarize(times)


class AsyncDevice:
    """A stand-in for a GPU's stream: `launch(seconds)` queues that much work and returns at once; one
    background thread runs the queue in order; `synchronize()` waits until it is empty."""

    def __init__(self):
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            seconds = self._queue.get()
            time.sleep(seconds)  # the "kernel"
            self._queue.task_done()

    def launch(self, seconds: float) -> None:
        self._queue.put(seconds)

    def synchronize(self) -> None:
        self._queue.join()


# ---- the cases, each built on a device at a scale (1 = the source material's sizes)


def _sum(device, scale):
    x = torch.randn(max(1, int(100_000 * scale)), 10, device=device)
    return f"sum of a {x.shape[0]}x10 tensor", lambda: x.sum()


def _matmul(device, scale):
    n = max(64, int(4096 * scale ** 0.5))
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    return f"matrix product {n}x{n} (fp32)", lambda: a @ b


def _linear_step(device, scale):
    rows, features = max(10, int(10_000 * scale)), max(100, int(100_000 * scale))
    x, y = torch.randn(rows, features, device=device), torch.randint(0, 10, (rows,), device=device)
    model = nn.Linear(features, 10).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return f"train step Linear({features}->10), {rows} samples", lambda: _step(model, opt, x, y)


def _cnn_step(device, scale):
    batch = max(8, int(512 * scale))
    model = WORKLOADS["cnn"].build_model(0).to(device)
    x, y = (t.to(device) for t in SyntheticData(WORKLOADS["cnn"], 0, batch).batch(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return f"train step LeNet CNN, batch {batch}", lambda: _step(model, opt, x, y)


def _step(model, opt, x, y):
    opt.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


CASES = [_sum, _matmul, _linear_step, _cnn_step]


@dataclass
class Line:
    case: str
    device: str
    synced: dict  # summarize(): p50_ms, min_ms, max_ms, ...
    naive: dict
    others_cpu: float | None = None  # share of the CPU other processes used meanwhile (world/load.py)


def run(scale: float = 1.0, repeats: int = 10, devices: list[torch.device] | None = None,
        progress: Callable[[str], None] = lambda s: None) -> list[Line]:
    """Every case on every device (CPU, then the first GPU if there is one), timed both ways, plus NumPy
    vs CuPy and the simulated asynchronous device."""
    devices = devices or [torch.device("cpu")] + ([torch.device("cuda", 0)] if gpu_count() else [])
    lines = []
    for make in CASES:
        for device in devices:
            name, fn = make(device, scale)
            progress(f"{name} on {device}")
            sync, watch = synchronizer(device), implausible.Watch()
            synced, naive = time_synced(fn, sync, repeats), time_naive(fn, sync, repeats)
            lines.append(Line(name, str(device), synced, naive, watch.stop()))
            del fn
    lines += numpy_vs_cupy(scale, repeats)
    sim = AsyncDevice()
    step_s = 0.02
    fn = lambda: sim.launch(step_s)  # noqa: E731
    lines.append(Line(f"simulated async device, {step_s * 1e3:.0f} ms steps", "simulated",
                      time_synced(fn, sim.synchronize, repeats), time_naive(fn, sim.synchronize, repeats)))
    return lines


def numpy_vs_cupy(scale: float, repeats: int) -> list[Line]:
    """The matrix product in NumPy (CPU) and, when CuPy and a GPU are here, CuPy (synchronized through
    its stream, the same way)."""
    n = max(64, int(4096 * scale ** 0.5))
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
    name = f"matrix product {n}x{n}, NumPy / CuPy"
    watch = implausible.Watch()
    synced, naive = time_synced(lambda: a @ b, lambda: None, repeats), time_naive(lambda: a @ b, lambda: None, repeats)
    lines = [Line(name, "numpy (cpu)", synced, naive, watch.stop())]
    try:
        import cupy
    except ImportError:
        return lines
    if cupy.cuda.runtime.getDeviceCount() < 1:
        return lines
    ca, cb = cupy.asarray(a), cupy.asarray(b)
    sync = cupy.cuda.get_current_stream().synchronize
    lines.append(Line(name, "cupy (cuda:0)", time_synced(lambda: ca @ cb, sync, repeats),
                      time_naive(lambda: ca @ cb, sync, repeats)))
    return lines


def cupy_status() -> str:
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install cupy-cuda12x on a CUDA machine): its row was not run"
    return "CuPy is installed"
