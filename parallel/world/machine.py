"""What hardware is here, read without taking it: the CPU, the GPUs (through NVML, or a short-lived child
process), why GPUs that are here cannot be used, the distributed backends, and `environment`, what a
result was measured on. The CUDA calls of the package are devices.py's; this module asks it how many GPUs
torch sees.
"""

from __future__ import annotations

import contextlib
import os
import platform

import torch

from parallel.world import devices


def unusable_gpus() -> str | None:
    """Why GPUs that are here cannot be used by this torch, or None (none here, or CUDA works). A driver
    older than the CUDA the wheel was built for, or a CPU-only torch (a venv made on another machine),
    leaves torch.cuda.is_available() False with GPUs in the machine: `auto` then runs on the CPU, and says
    so with this reason instead of "no CUDA device here"."""
    if devices.gpu_count():
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

    with nvml() as pynvml:
        if pynvml is not None:
            try:
                version = pynvml.nvmlSystemGetCudaDriverVersion()
                return pynvml.nvmlDeviceGetCount(), f"{version // 1000}.{version % 1000 // 10}"
            except Exception:  # noqa: BLE001 - NVML loads but does not answer: the device files say
                pass
    return len(glob.glob("/dev/nvidia[0-9]*")), ""


@contextlib.contextmanager
def nvml():
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
    return {"model": model, "cores": devices.cpu_cores(), "torch_threads": torch.get_num_threads()}


def cuda_info() -> list[dict]:
    """Every visible GPU's name, memory and capability, read without opening a CUDA context in this
    process. The comparison's parent process records this and then lives for the whole run: a context
    it held (mem_get_info makes one per GPU) would cost memory on every GPU and, in EXCLUSIVE_PROCESS
    compute mode, keep the children off the GPUs. NVML (nvidia-ml-py) answers without a context; where it
    does not load, a short-lived child process asks CUDA and exits, taking its contexts with it."""
    if not devices.gpu_count():
        return []
    return _nvml_info() or _child_cuda_info()


def _nvml_info() -> list[dict] | None:
    with nvml() as pynvml:
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
    if not indices or not devices.gpu_count():
        return None
    with nvml() as pynvml:
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
    for v in ids[: devices.gpu_count()]:
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
        "nccl": dist.is_available() and dist.is_nccl_available() and devices.gpu_count() > 0,
        "mpi": dist.is_available() and dist.is_mpi_available(),
    }


def environment(spec) -> dict:
    """What a result was measured on (`spec`: the run's DeviceSpec); stored with every results.json."""
    import datetime
    import socket

    cores = devices.cpu_cores()
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "hostname": socket.gethostname(),
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "devices": str(spec),
        "device_kind": spec.kind_label,
        "backend": spec.backend,
        **({"tf32": devices.TF32} if spec.real else {}),
        "cpu": cpu_info(),
        "gpus": cuda_info(),
        "threads_per_device": spec.threads_per_device(),
        "oversubscribed": (not spec.real) and spec.count > cores,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        **({"gpus_unusable": why} if not spec.real and (why := unusable_gpus()) else {}),
    }
