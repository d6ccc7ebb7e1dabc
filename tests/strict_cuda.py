"""A strict stand-in for CUDA, so the CUDA paths' logic is tested on a machine with no GPU.

`StrictCuda` takes the place of `parallel.world.devices.CUDA` (the one object every CUDA call of the package goes
through) and enforces the rules of CUDA's that the project relies on, as torch 2.13 states them:

- memory statistics need CUDA initialised: `reset_peak_memory_stats(i)` with an explicit index skips
  torch's lazy init and the allocator raises "Invalid device argument i: did you call init?"
  (torch/cuda/memory.py; pytorch#117130);
- a device index must exist;
- an event records on the current device's stream, and `elapsed_time` raises unless both events have
  completed, i.e. their device was synchronized after they were recorded (c10/cuda/CUDAEvent.h:
  "Both events must be completed before calculating elapsed time.");
- the current device is per thread.

Everything is logged in order (`log`: ("init", i), ("sync", i), ("reset", i), ("peak", i), ("record", i),
("clock",) ...), so a test can check what was called, on which device, in which order. `with on_cpu(cuda):`
(strict_on_cpu.py) puts tensors asked for on "cuda:i" on the CPU instead (and logs ("to", i)), so whole
strategies run with CUDA device objects end to end, and tracks where each would be, refusing what CUDA
refuses: two devices in one op, a GPU index into a CPU tensor (strict_devices.py; issue 45). The torch.cuda
calls torch's own distributed code makes there (streams, events, the current device) come here
(`torch_cuda`).
"""

from __future__ import annotations

import contextlib
import threading
import time

import torch

from parallel.world.devices import Cuda
from tests.strict_on_cpu import on_cpu

__all__ = ["Clock", "StrictCuda", "StrictEvent", "on_cpu", "synced_before_every_clock"]


class StrictCuda(Cuda):
    def __init__(self, count: int = 2):
        self.count = count
        self.initialised = False
        self.log: list[tuple] = []
        self._tls = threading.local()
        self._lock = threading.Lock()

    # -- rules
    def _index(self, device: torch.device) -> int:
        if device.type != "cuda" or device.index is None or not 0 <= device.index < self.count:
            raise RuntimeError(f"CUDA error: invalid device ordinal ({device}; {self.count} device(s))")
        return device.index

    def _stats(self, device: torch.device, what: str) -> int:
        i = self._index(device)
        if not self.initialised:
            raise RuntimeError(f"Invalid device argument {i}: did you call init?")
        self.note(what, i)
        return i

    def note(self, *entry) -> None:
        with self._lock:
            self.log.append(entry)

    @property
    def current(self) -> int | None:
        return getattr(self._tls, "current", None)

    # -- the Cuda surface
    def is_available(self) -> bool:
        return self.count > 0  # StrictCuda(count=0): a machine without GPUs, whatever this one has

    def device_count(self) -> int:
        return self.count

    def activate(self, device: torch.device) -> None:
        i = self._index(device)
        self.initialised = True
        self._tls.current = i
        self.note("init", i)

    def synchronize(self, device: torch.device) -> None:
        self.note("sync", self._index(device))  # torch.cuda.synchronize lazy-initialises by itself

    def exact_fp32(self) -> None:  # process-wide settings in torch.backends: logged, not applied here
        self.note("exact_fp32")

    def reset_peak(self, device: torch.device) -> None:
        self._stats(device, "reset")

    def peak_allocated(self, device: torch.device) -> int:
        return 1000 * (self._stats(device, "peak") + 1)  # a different figure per device

    def peak_reserved(self, device: torch.device) -> int:
        return 2000 * (self._stats(device, "reserved") + 1)  # at least what was allocated, as CUDA's is

    def record_history(self, device: torch.device, on: bool) -> None:
        if not self.initialised:
            raise RuntimeError("_record_memory_history before CUDA was initialised")
        self.note("history", self._index(device), on)

    def dump_snapshot(self, path: str) -> None:
        """A stand-in snapshot: torch's pickle layout (segments, device_traces), empty."""
        import pickle

        if not self.initialised:
            raise RuntimeError("_dump_snapshot before CUDA was initialised")
        self.note("snapshot", path)
        with open(path, "wb") as f:
            pickle.dump({"segments": [], "device_traces": []}, f)

    def memory(self, device: torch.device) -> dict[str, int]:
        i = self._stats(device, "memory")
        return {"allocated": 0, "reserved": 0, "peak_allocated": 0, "total": 80 << 30, "free": (80 - i) << 30}

    def empty_cache(self) -> None:
        if not self.initialised:
            raise RuntimeError("empty_cache before CUDA was initialised")
        self.note("empty_cache")

    def cap_memory(self, device: torch.device, nbytes: int) -> None:
        """torch.cuda.set_per_process_memory_fraction's rules: a float fraction of the total in [0, 1]."""
        fraction = min(1.0, nbytes / (80 << 30))
        if not isinstance(fraction, float) or not 0 <= fraction <= 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.note("cap", self._index(device), fraction)

    def event(self, device: torch.device):
        return StrictEvent(self, self._index(device))

    @contextlib.contextmanager
    def device_context(self, device: torch.device):
        before = self.current
        self._tls.current = self._index(device)
        try:
            yield
        finally:
            self._tls.current = before

    # -- torch.cuda as torch's distributed code calls it (DeviceMesh, FSDP2's streams): on_cpu puts these in
    def torch_cuda(self) -> dict:
        def set_device(device) -> None:
            self._tls.current = self._index(torch.device("cuda", getattr(device, "index", device)))

        return {"current_device": lambda: self.current or 0, "set_device": set_device,
                "device_count": lambda: self.count, "is_initialized": lambda: self.initialised,
                "Stream": FakeStream, "current_stream": lambda device=None: FakeStream(),
                "default_stream": lambda device=None: FakeStream(), "stream": lambda s: contextlib.nullcontext(),
                "Event": FakeEvent, "synchronize": lambda device=None: self.note("sync", self.current or 0),
                # torch.random.fork_rng around pipelining's shape inference: the CPU's generator stands in
                "get_rng_state": lambda device="cuda": torch.get_rng_state(), "set_rng_state": lambda *a, **k: None}

    # -- what the tests read
    def entries(self, kind: str) -> list[tuple]:
        return [e for e in self.log if e[0] == kind]


class StrictEvent:
    def __init__(self, cuda: StrictCuda, device: int):
        self.cuda, self.device = cuda, device
        self.at: float | None = None
        self.seq: int | None = None

    def record(self, stream=None) -> None:
        if self.cuda.current != self.device:
            raise RuntimeError(f"event of cuda:{self.device} recorded while cuda:{self.cuda.current} is current")
        with self.cuda._lock:
            self.at, self.seq = time.perf_counter(), len(self.cuda.log)
            self.cuda.log.append(("record", self.device))

    def _completed(self) -> bool:
        return self.seq is not None and any(e == ("sync", self.device) for e in self.cuda.log[self.seq:])

    def elapsed_time(self, end: StrictEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("Both events must be recorded before calculating elapsed time.")
        if not (self._completed() and end._completed()):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1e3


class FakeStream:
    """A CUDA stream with nothing to order: the stand-in runs every op at once, in program order."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event or FakeEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class FakeEvent(FakeStream):
    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass


class Clock:
    """A clock that logs its reads into the stand-in's log, to check what was synchronized before each."""

    def __init__(self, cuda: StrictCuda):
        self.cuda = cuda

    def __call__(self) -> float:
        self.cuda.note("clock")
        return time.perf_counter()


def synced_before_every_clock(log: list[tuple], devices: set[int]) -> bool:
    """Every ("clock",) entry is immediately preceded by a synchronize of each of `devices`."""
    seen: set[int] = set()
    for e in log:
        if e[0] == "sync":
            seen.add(e[1])
        elif e[0] == "clock":
            if not devices <= seen:
                return False
            seen = set()
        else:
            seen = set()
    return True
