"""Device discovery, the `--devices` grammar, and the CPU/GPU substitutions made once at set-up.

    auto         every visible CUDA device, else cpu:2
    cpu:N        N virtual devices on this CPU; the cores are split between them
    cuda:0,1,..  real GPUs (indices into what CUDA_VISIBLE_DEVICES leaves visible)
"""

from __future__ import annotations

import contextlib
import os
import platform
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parallel.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda"
    ids: tuple[int, ...]  # CUDA indices; for cpu, 0..N-1 names the virtual devices

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def real(self) -> bool:
        return self.kind == "cuda"

    def device(self, i: int) -> torch.device:
        """The torch device that the i-th device of the list runs on."""
        return torch.device("cuda", self.ids[i]) if self.real else torch.device("cpu")

    def threads_per_device(self) -> int:
        """CPU threads each device (thread or process) may use: the cores split, never oversubscribed
        (at least one, so cpu:3 on two cores does oversubscribe, and environment() says so)."""
        return max(1, cpu_cores() // self.count)

    def __str__(self) -> str:
        if self.real:
            return "cuda:" + ",".join(map(str, self.ids))
        return f"cpu:{self.count}"


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_devices(text: str) -> DeviceSpec:
    """Parse `auto`, `cpu:N` or `cuda:i,j,...` against the hardware that is here."""
    text = text.strip()
    if text == "auto":
        n = gpu_count()
        return DeviceSpec("cuda", tuple(range(n))) if n else DeviceSpec("cpu", (0, 1))
    kind, sep, rest = text.partition(":")
    if kind == "cpu":
        if sep and not rest.isdigit():
            raise ConfigError(f"--devices {text!r}: cpu takes a count of virtual devices, e.g. cpu:2")
        n = int(rest) if sep else 1
        if not 1 <= n <= 64:
            raise ConfigError(f"--devices {text!r}: the virtual device count must be 1..64, got {n}")
        return DeviceSpec("cpu", tuple(range(n)))
    if kind == "cuda":
        parts = rest.split(",") if sep and rest else []
        if not parts or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--devices {text!r}: expected cuda:0 or cuda:0,1,...")
        ids = tuple(int(p) for p in parts)
        if len(set(ids)) != len(ids):
            raise ConfigError(f"--devices {text!r}: a device is listed twice")
        visible = gpu_count()
        if visible == 0:
            raise ConfigError(f"--devices {text!r}: CUDA is not available here (torch {torch.__version__})")
        if max(ids) >= visible:
            raise ConfigError(f"--devices {text!r}: only {visible} CUDA device(s) are visible")
        return DeviceSpec("cuda", ids)
    raise ConfigError(f"--devices {text!r}: expected auto, cpu:N or cuda:0,1,...")


# ---- every CUDA call the package makes, in one place


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

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def memory(self, device: torch.device) -> dict[str, int]:
        free, total = torch.cuda.mem_get_info(device)
        return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
                "peak_allocated": torch.cuda.max_memory_allocated(device), "total": total, "free": free}

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

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


# ---- discovery


def cpu_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"model": model, "cores": cpu_cores(), "torch_threads": torch.get_num_threads()}


def cuda_info() -> list[dict]:
    """Every visible GPU's name, memory and capability, read without opening a CUDA context in this
    process. The comparison's parent process records this and then lives for the whole run: a context
    it held (mem_get_info makes one per GPU) would cost memory on every GPU and, in EXCLUSIVE_PROCESS
    compute mode, keep the children off the GPUs. NVML (nvidia-ml-py) answers without a context; where it
    does not load, a short-lived child process asks CUDA and exits, taking its contexts with it."""
    if not gpu_count():
        return []
    return _nvml_info() or _child_cuda_info()


def _nvml_info() -> list[dict] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, or no driver library: the child process answers
        return None
    try:
        rows = []
        for i, handle in enumerate(_visible_nvml_handles(pynvml)):
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            rows.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "total_bytes": memory.total, "free_bytes": memory.free, "capability": f"{major}.{minor}",
                         "source": "nvml"})
        return rows or None
    except Exception:  # noqa: BLE001 - e.g. MIG instances, which NVML names differently: ask CUDA
        return None
    finally:
        pynvml.nvmlShutdown()


def gpu_process_ids(indices: list[int]) -> set[int] | None:
    """The pids of every process computing on the GPUs CUDA numbers `indices` (any user's), through NVML;
    None where NVML does not answer (no driver library, no GPU): the caller then knows nothing."""
    if not indices or not gpu_count():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, or no driver library
        return None
    try:
        handles = _visible_nvml_handles(pynvml)
        return {p.pid for i in indices if i < len(handles)
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handles[i])}
    except Exception:  # noqa: BLE001 - MIG, permissions: unknown rather than wrong
        return None
    finally:
        pynvml.nvmlShutdown()


def _visible_nvml_handles(pynvml) -> list:
    """NVML handles of the GPUs CUDA sees, in CUDA's order, from CUDA_VISIBLE_DEVICES (indices or GPU-
    UUIDs). NVML numbers GPUs by PCI bus; CUDA does too under CUDA_DEVICE_ORDER=PCI_BUS_ID, and on the
    usual machines (identical GPUs) its default order agrees. torch maps NVML indices the same way."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        ids = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
    else:
        ids = [v.strip() for v in visible.split(",") if v.strip()]
    handles = []
    for v in ids[: gpu_count()]:
        if v.isdigit():
            handles.append(pynvml.nvmlDeviceGetHandleByIndex(int(v)))
        elif v.startswith("GPU-"):
            handles.append(pynvml.nvmlDeviceGetHandleByUUID(v))
        else:
            raise ValueError(f"CUDA_VISIBLE_DEVICES entry {v!r}")
    return handles


_CHILD_QUERY = """
import json, torch
rows = []
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    free, total = torch.cuda.mem_get_info(i)
    rows.append({"index": i, "name": p.name, "total_bytes": total, "free_bytes": free,
                 "capability": f"{p.major}.{p.minor}", "source": "cuda (child process)"})
print(json.dumps(rows))
"""


def _child_cuda_info() -> list[dict]:
    import json
    import subprocess
    import sys

    try:
        p = subprocess.run([sys.executable, "-c", _CHILD_QUERY], capture_output=True, text=True, timeout=120)
        return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else []
    except (subprocess.TimeoutExpired, ValueError, IndexError):
        return []


def backends() -> dict[str, bool]:
    import torch.distributed as dist

    return {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available() and gpu_count() > 0,
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }


def environment(spec: DeviceSpec) -> dict:
    """What a result was measured on; stored with every results.json."""
    import datetime
    import socket

    cores = cpu_cores()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": str(spec),
        "device_kind": "real" if spec.real else "virtual",
        "cpu": cpu_info(),
        "gpus": cuda_info(),
        "threads_per_device": spec.threads_per_device(),
        "oversubscribed": (not spec.real) and spec.count > cores,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
