"""Device discovery, the `--devices` grammar, and the CPU/GPU substitutions made once at set-up.

    auto         every visible CUDA device (one GPU: cuda:0x2, shared), else cpu:2
    cpu:N        N virtual devices on this CPU; the cores are split between them
    cuda:0,1,..  real GPUs (indices into what CUDA_VISIBLE_DEVICES leaves visible)
    cuda:IxK     K ranks (or replicas) sharing the one GPU I, the way cpu:K shares the CPU: every CUDA path
                 runs on a real GPU, the parallel speed does not. nccl refuses two ranks on one GPU (NCCL
                 2.28.9: "invalid usage" at init, measured on an H200), so these ranks talk over gloo,
                 which takes CUDA tensors in its collectives but not in send/recv (see SHARED_GLOO).
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
        """Runs on GPUs (shared or not), as opposed to virtual devices on the CPU."""
        return self.kind == "cuda"

    @property
    def shared(self) -> bool:
        """Several ranks on one GPU (cuda:0x2): real devices, but not parallel ones."""
        return self.real and len(set(self.ids)) < len(self.ids)

    @property
    def kind_label(self) -> str:
        """What the devices are, for rows and notes: real GPUs, one GPU shared, or virtual CPU devices."""
        return "shared" if self.shared else "real" if self.real else "virtual"

    @property
    def backend(self) -> str:
        """The process group's backend: nccl on GPUs of their own, gloo on the CPU and on a shared GPU."""
        return "nccl" if self.real and not self.shared else "gloo"

    def device(self, i: int) -> torch.device:
        """The torch device that the i-th device of the list runs on."""
        return torch.device("cuda", self.ids[i]) if self.real else torch.device("cpu")

    def first(self, n: int) -> DeviceSpec:
        """n devices of the same kind, taken from this list: its first n GPUs (the user's own, cuda:4,5,...),
        n ranks on the shared GPU, or n virtual CPU devices (any n: they are made, not found)."""
        if self.kind == "cpu":
            return DeviceSpec("cpu", tuple(range(n)))
        if self.shared:
            return DeviceSpec("cuda", (self.ids[0],) * n)
        if n > self.count:
            raise ConfigError(f"{n} devices asked of {self}, which has {self.count} (to share a GPU: "
                              f"cuda:{self.ids[0]}x{n})")
        return DeviceSpec("cuda", self.ids[:n])

    def threads_per_device(self) -> int:
        """CPU threads each device (thread or process) may use: the cores split, never oversubscribed
        (at least one, so cpu:3 on two cores does oversubscribe, and environment() says so)."""
        return max(1, cpu_cores() // self.count)

    def __str__(self) -> str:
        if self.shared:
            return f"cuda:{self.ids[0]}x{self.count}"
        if self.real:
            return "cuda:" + ",".join(map(str, self.ids))
        return f"cpu:{self.count}"


# What gloo does with CUDA tensors, measured on an H200 (torch 2.11, two ranks on cuda:0): all_reduce
# (SUM, AVG), broadcast, reduce, all_gather(_into_tensor), reduce_scatter(_tensor), all_to_all_single,
# gather, scatter, barrier, monitored_barrier, DDP and FSDP2's fully_shard work; all_to_all of a list is
# refused ("Backend gloo does not support alltoall"); send/recv of a CUDA tensor aborts the sending
# process ("writev ... Bad address": gloo hands the device pointer to the socket). So torch's pipelining
# (isend/irecv of activations) cannot run on a shared GPU, and the strategies built on it say so.
SHARED_GLOO_NO_P2P = ("gloo, the only backend for ranks sharing one GPU, cannot send CUDA tensors point to point "
                      "(measured: send/recv aborts the process)")

SHARED_GLOO_NO_DTENSOR = ("DTensor's redistributions (torch's functional collectives) crash on gloo with CUDA "
                          "tensors, the only backend for ranks sharing one GPU (measured: SIGSEGV)")

SHARE_DEFAULT = 2  # ranks sharing the GPU when `auto` finds exactly one


def cpu_cores() -> int:
    """Cores this process may run on (respects taskset/cgroups affinity, unlike os.cpu_count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def parse_devices(text: str) -> DeviceSpec:
    """Parse `auto`, `cpu:N` or `cuda:i,j,...` against the hardware that is here."""
    text = text.strip()
    if text == "auto":
        n = gpu_count()
        if n == 1:  # one GPU: every CUDA path still runs, on ranks that share it (the row says so)
            return DeviceSpec("cuda", (0,) * SHARE_DEFAULT)
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
        index, x, share = rest.partition("x")
        if x and index.isdigit() and share.isdigit():  # cuda:IxK, one GPU shared by K ranks
            if not 1 <= int(share) <= 16:
                raise ConfigError(f"--devices {text!r}: ranks sharing one GPU must be 1..16, got {share}")
            parts = [index] * int(share)
        elif not parts or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--devices {text!r}: expected cuda:0, cuda:0,1,... or cuda:0x2 (2 ranks sharing "
                              "GPU 0)")
        ids = tuple(int(p) for p in parts)
        if len(set(ids)) != len(ids) and not x:
            raise ConfigError(f"--devices {text!r}: a device is listed twice (to share one GPU between ranks, "
                              f"cuda:{ids[0]}x2)")
        visible = gpu_count()
        if visible == 0:
            raise ConfigError(f"--devices {text!r}: " + (unusable_gpus() or f"CUDA is not available here (torch "
                                                                           f"{torch.__version__}, no NVIDIA GPU)"))
        if max(ids) >= visible:
            raise ConfigError(f"--devices {text!r}: only {visible} CUDA device(s) are visible")
        return DeviceSpec("cuda", ids)
    raise ConfigError(f"--devices {text!r}: expected auto, cpu:N, cuda:0,1,... or cuda:IxK")


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


def unusable_gpus() -> str | None:
    """Why GPUs that are here cannot be used by this torch, or None (none here, or CUDA works). A driver
    older than the CUDA the wheel was built for, or a CPU-only torch (a venv made on another machine),
    leaves torch.cuda.is_available() False with GPUs in the machine: `auto` then runs on the CPU, and says
    so with this reason instead of "no CUDA device here"."""
    if gpu_count():
        return None
    present, driver = _nvidia_present()
    if not present:
        return None
    if torch.version.cuda is None:
        return (f"{present} NVIDIA GPU(s) here, but this torch ({torch.__version__}) is a CPU-only build: install "
                "a CUDA build (e.g. TORCH_SPEC='torch==2.13.0' in a fresh venv: ./launch.sh setup)")
    return (f"{present} NVIDIA GPU(s) here, but torch {torch.__version__} (built for CUDA {torch.version.cuda}) "
            f"cannot use them: torch.cuda.is_available() is False" +
            (f"; the driver supports CUDA {driver}: a driver older than the build's CUDA is the usual cause"
             if driver else ""))


def _nvidia_present() -> tuple[int, str]:
    """(GPUs the NVIDIA driver shows, the CUDA version its driver supports, or ""): NVML where it loads,
    else the device files."""
    import glob

    with _nvml() as nvml:
        if nvml is not None:
            try:
                version = nvml.nvmlSystemGetCudaDriverVersion()
                return nvml.nvmlDeviceGetCount(), f"{version // 1000}.{version % 1000 // 10}"
            except Exception:  # noqa: BLE001 - NVML loads but does not answer: the device files say
                pass
    return len(glob.glob("/dev/nvidia[0-9]*")), ""


@contextlib.contextmanager
def _nvml():
    """pynvml, initialised for the block and shut down after it; None where NVML does not load (not
    installed, or no driver library)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - not installed, or no driver library
        yield None
        return
    try:
        yield pynvml
    finally:
        pynvml.nvmlShutdown()


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
    with _nvml() as pynvml:
        if pynvml is None:  # the child process answers
            return None
        try:
            rows = []
            for i, handle in enumerate(_visible_nvml_handles(pynvml)):
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                rows.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                             "total_bytes": memory.total, "free_bytes": memory.free,
                             "capability": f"{major}.{minor}", "source": "nvml"})
            return rows or None
        except Exception:  # noqa: BLE001 - e.g. MIG instances, which NVML names differently: ask CUDA
            return None


def gpu_process_ids(indices: list[int]) -> set[int] | None:
    """The pids of every process computing on the GPUs CUDA numbers `indices` (any user's), through NVML;
    None where NVML does not answer (no driver library, no GPU): the caller then knows nothing."""
    if not indices or not gpu_count():
        return None
    with _nvml() as pynvml:
        if pynvml is None:
            return None
        try:
            handles = _visible_nvml_handles(pynvml)
            return {p.pid for i in indices if i < len(handles)
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handles[i])}
        except Exception:  # noqa: BLE001 - MIG, permissions: unknown rather than wrong
            return None


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
        "device_kind": spec.kind_label,
        "backend": spec.backend,
        **({"tf32": TF32} if spec.real else {}),
        "cpu": cpu_info(),
        "gpus": cuda_info(),
        "threads_per_device": spec.threads_per_device(),
        "oversubscribed": (not spec.real) and spec.count > cores,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **({"gpus_unusable": why} if not spec.real and (why := unusable_gpus()) else {}),
    }
