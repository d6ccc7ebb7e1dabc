"""Every CUDA call the package makes, and the CPU/GPU substitutions made once at set-up, so that strategy
bodies never branch on the device type. The `--devices` grammar is devicespec.py's; what hardware is
here (NVML, the CPU's model, the environment a result was measured on) is machine.py's.
"""

from __future__ import annotations

import contextlib
import os
import resource
import time
from collections.abc import Callable

import torch

# Ranks sharing one GPU (devicespec's cuda:IxK) talk over gloo. What gloo does with CUDA tensors, measured
# on an H200 (torch 2.11, two ranks on cuda:0): all_reduce (SUM, AVG), broadcast, reduce,
# all_gather(_into_tensor), reduce_scatter(_tensor), all_to_all_single, gather, scatter, barrier,
# monitored_barrier, DDP and FSDP2's fully_shard work; all_to_all of a list is refused ("Backend gloo does
# not support alltoall"); send/recv of a CUDA tensor aborts the sending process ("writev ... Bad address":
# gloo hands the device pointer to the socket). So torch's pipelining (isend/irecv of activations) cannot
# run on a shared GPU, and the strategies built on it say so.
SHARED_GLOO_NO_P2P = ("gloo, the only backend for ranks sharing one GPU, cannot send CUDA tensors point to point "
                      "(measured: send/recv aborts the process)")

SHARED_GLOO_NO_DTENSOR = ("DTensor's redistributions (torch's functional collectives) crash on gloo with CUDA "
                          "tensors, the only backend for ranks sharing one GPU (measured: SIGSEGV)")


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Cuda:
    """The CUDA runtime as this package uses it. Every CUDA call outside the GPU-basics lessons goes
    through `CUDA` below, so that the rules the project relies on are written down once, and the tests
    can put a strict stand-in in its place (tests/strict_cuda.py) that enforces them on a machine with no
    GPU:

    - memory statistics need CUDA initialised first: `reset_peak_memory_stats(i)` with an explicit index
      skips torch's lazy initialisation, and the caching allocator then fails ("Invalid device argument
      ... did you call init?", pytorch#117130). `activate` initialises, once, in one place.
    - a clock read measures queued work only if every device the process drives was synchronized first.
    - intervals *inside* a step are timed with events, not by synchronizing (which stops the host from
      running ahead and so changes what is measured).
    """

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0

    def activate(self, device: torch.device) -> None:
        """Initialise CUDA in this process and make `device` its current device."""
        torch.cuda.init()
        torch.cuda.set_device(device)

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def exact_fp32(self) -> None:
        """fp32 matrix products and convolutions in IEEE fp32, not TF32 (10-bit mantissa). cuDNN
        convolutions default to TF32 on Ampere and later (torch.backends.cudnn.conv.fp32_precision is
        "tf32"); the oracle's tolerances were measured in fp32, and TF32 alone moves a CNN's loss by more
        than they allow. torch 2.9+ has the fp32_precision settings (mixing them with the old allow_tf32
        flags is deprecated: once the new ones are set, reading `cudnn.allow_tf32` raises, measured on 2.13);
        older releases only the flags. cuDNN's RNNs too, for a user's model that has them."""
        cudnn = torch.backends.cudnn
        if hasattr(cudnn, "conv") and hasattr(torch.backends.cuda.matmul, "fp32_precision"):
            torch.backends.cuda.matmul.fp32_precision = "ieee"
            cudnn.conv.fp32_precision = "ieee"
            cudnn.rnn.fp32_precision = "ieee"
        else:
            torch.backends.cuda.matmul.allow_tf32 = False
            cudnn.allow_tf32 = False

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def peak_reserved(self, device: torch.device) -> int:
        """What the caching allocator held at its most (allocated + cached free blocks): nvidia-smi's view."""
        return torch.cuda.max_memory_reserved(device)

    def record_history(self, device: torch.device, on: bool) -> None:
        """Start (or stop) recording every allocation and free with its stack, for a snapshot: torch's
        _record_memory_history, the same signature in torch 2.11 and 2.13 (100,000 entries kept)."""
        torch.cuda.memory._record_memory_history("all" if on else None, max_entries=100_000, device=device)

    def dump_snapshot(self, path: str) -> None:
        """The allocator's state and recorded history as a pickle that pytorch.org/memory_viz opens."""
        torch.cuda.memory._dump_snapshot(path)

    def memory(self, device: torch.device) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "peak_allocated": torch.cuda.max_memory_allocated(device), "total": total, "free": free}

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def cap_memory(self, device: torch.device, nbytes: int) -> None:
        """This process may allocate at most `nbytes` on `device`: torch's caching allocator raises out of
        memory beyond total memory x fraction (torch/cuda/memory.py: the fraction must be a float in
        [0, 1]; the call initialises CUDA lazily by itself)."""
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(float(min(1.0, nbytes / total)), device)

    def event(self, device: torch.device):
        """A timing event; `record()` puts it on the current stream of `device` (the caller's)."""
        return torch.cuda.Event(enable_timing=True)

    def device_context(self, device: torch.device):
        return torch.cuda.device(device)


CUDA = Cuda()


def gpu_count() -> int:
    """CUDA devices visible to this process (0 without CUDA)."""
    return CUDA.device_count()


def cuda_memory(device: torch.device) -> dict[str, int]:
    """allocated, reserved, peak allocated, total and free bytes of one GPU (CUDA initialised)."""
    return CUDA.memory(device)


def empty_cache() -> None:
    """Hand the caching allocator's unused reserve back to the GPU (it frees no live tensor)."""
    if CUDA.is_available():
        CUDA.empty_cache()


# ---- substitutions made once, so strategy bodies never branch on the device type (nanochat's habit)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for the device's queued work. Every clock read in the harness is preceded by this:
    CUDA kernels are asynchronous, so an unsynchronized clock measures only the launches."""
    if device.type == "cuda":
        return lambda: CUDA.synchronize(device)
    return lambda: None


def synchronizer_all(devices) -> Callable[[], None]:
    """One wait for every CUDA device of a list (a no-op for CPU devices)."""
    syncs = [synchronizer(d) for d in dict.fromkeys(devices) if d.type == "cuda"]
    return lambda: [s() for s in syncs] and None


def device_context(device: torch.device):
    """Make `device` current for the calling thread (a device thread of manual_dp, a pipeline stage)."""
    return CUDA.device_context(device) if device.type == "cuda" else contextlib.nullcontext()


def activate(devices) -> None:
    """Initialise CUDA in this process (its allocator is set up for every visible device at once) and
    make the first of `devices` current. Called before anything reads memory statistics or puts a tensor
    on a GPU. A no-op for CPU devices."""
    cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
    if cuda:
        CUDA.activate(cuda[0])


def exact_fp32(devices) -> None:
    """TF32 off for every run on GPUs (Cuda.exact_fp32): strategies are checked against `single` with
    tolerances measured in fp32. A no-op for CPU devices, whose fp32 is IEEE already."""
    if any(d.type == "cuda" for d in devices):
        CUDA.exact_fp32()


TF32 = "off: matrix products and cuDNN convolutions in IEEE fp32 (devices.exact_fp32), as the tolerances assume"


def cap_memory(devices, nbytes: int) -> None:
    """--memory-cap on GPUs: each CUDA device's allocator held to `nbytes` (CPU devices have no allocator
    of their own to cap: there the planner's refusal before the run is what holds)."""
    for d in devices:
        if d.type == "cuda":
            CUDA.cap_memory(d, nbytes)


def reset_peak_memory(devices) -> None:
    for d in dict.fromkeys(devices):
        if d.type == "cuda":
            CUDA.reset_peak(d)


def peak_memory(devices) -> tuple[list[int], str]:
    """([bytes per device], what they are): CUDA's peak allocated bytes of every device the process
    drives, or on CPU the process's peak resident set (once: virtual devices share the process)."""
    cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
    if cuda:
        return [CUDA.peak_allocated(d) for d in cuda], "cuda_max_allocated"
    return [resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024], "process_peak_rss"  # Linux: KiB


def peak_reserved(devices) -> list[int]:
    """CUDA's peak reserved bytes of every CUDA device the process drives ([] on the CPU)."""
    return [CUDA.peak_reserved(d) for d in dict.fromkeys(devices) if d.type == "cuda"]


@contextlib.contextmanager
def memory_history(device: torch.device, path: str | None):
    """Record the allocator's history on `device` while inside, and dump it to `path` on the way out (no
    path, or not CUDA: nothing)."""
    if path is None or device.type != "cuda":
        yield
        return
    CUDA.record_history(device, True)
    try:
        yield
    finally:
        CUDA.dump_snapshot(path)
        CUDA.record_history(device, False)


def _record_events(devices) -> dict:
    """A timing event recorded now on each CUDA device's current stream, by device."""
    events = {}
    for d in devices:
        events[d] = CUDA.event(d)
        with device_context(d):
            events[d].record()
    return events


class IntervalClock:
    """Times intervals *inside* a step (manual_dp's phases, a pipeline stage's busy spells) on one clock
    per step, without stopping the host.

    CPU (virtual devices): work is done when the call returns, so a stamp is a host clock read.
    CUDA: a stamp is an event recorded on each device's current stream; it is resolved after the step,
    once the loop has synchronized, as milliseconds since a reference event recorded on the same device
    at the step's start (all devices are idle then, so the references coincide to within a launch).
    Synchronizing instead would keep the host from queueing ahead, inflating the very idle time measured.

        clock.start_step(); a = clock.stamp(devs); ...; b = clock.stamp(devs); clock.end_step()
        clock.seconds(a, first=True), clock.seconds(b)   # relative to the step's start
    """

    def __init__(self, devices):
        self.cuda = [d for d in dict.fromkeys(devices) if d.type == "cuda"]
        self._ref: dict = {}
        self._t0 = 0.0

    def start_step(self) -> None:
        self._t0 = time.perf_counter()
        self._ref = _record_events(self.cuda)

    def stamp(self, devices=None):
        """Now, on `devices` (default: every device of the clock)."""
        devices = [d for d in dict.fromkeys(devices or self.cuda) if d.type == "cuda"]
        return _record_events(devices) if devices else time.perf_counter()

    def end_step(self) -> None:
        """Wait for the step's last events (the step boundary, where the loop synchronizes anyway)."""
        for d in self.cuda:
            CUDA.synchronize(d)

    def seconds(self, stamp, first: bool = False) -> float:
        """A stamp as seconds since the step started: for one taken on several devices, the earliest
        (`first`, where an interval begins) or the latest (where it ends, when every device is done)."""
        if isinstance(stamp, float):
            return stamp - self._t0
        ms = [self._ref[d].elapsed_time(e) for d, e in stamp.items()]
        return (min(ms) if first else max(ms)) / 1e3

