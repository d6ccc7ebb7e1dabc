"""Device discovery, the `--devices` grammar, and the CPU/GPU substitutions made once at set-up.

    auto         every visible CUDA device, else cpu:2
    cpu:N        N virtual devices on this CPU; the cores are split between them
    cuda:0,1,..  real GPUs (indices into what CUDA_VISIBLE_DEVICES leaves visible)
"""

from __future__ import annotations

import os
import platform
import resource
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
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
        visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if visible == 0:
            raise ConfigError(f"--devices {text!r}: CUDA is not available here (torch {torch.__version__})")
        if max(ids) >= visible:
            raise ConfigError(f"--devices {text!r}: only {visible} CUDA device(s) are visible")
        return DeviceSpec("cuda", ids)
    raise ConfigError(f"--devices {text!r}: expected auto, cpu:N or cuda:0,1,...")


# ---- substitutions made once, so strategy bodies never branch on the device type (nanochat's habit)


def synchronizer(device: torch.device) -> Callable[[], None]:
    """Wait for the device's queued work. Every clock read in the harness is preceded by this:
    CUDA kernels are asynchronous, so an unsynchronized clock measures only the launches."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def synchronizer_all(devices) -> Callable[[], None]:
    """One wait for every CUDA device of a list (a no-op for CPU devices)."""
    syncs = [synchronizer(d) for d in dict.fromkeys(devices) if d.type == "cuda"]
    return lambda: [s() for s in syncs] and None


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they are): CUDA's peak allocated bytes, or on CPU the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda_max_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_peak_rss"  # Linux: KiB


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
    if not torch.cuda.is_available():
        return []
    rows = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        rows.append({"index": i, "name": p.name, "total_bytes": total, "free_bytes": free,
                     "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return rows


def backends() -> dict[str, bool]:
    import torch.distributed as dist

    return {
        "gloo": dist.is_available() and dist.is_gloo_available(),
        "nccl": dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available(),
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
