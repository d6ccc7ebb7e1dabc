"""Memory per device: what is allocated, what the allocator keeps reserved, the peak.

On CUDA, PyTorch's caching allocator keeps freed blocks *reserved* for reuse, so `nvidia-smi` shows more
than your tensors use; `torch.cuda.empty_cache()` hands the unused reserve back (it frees no tensor).
On CPU there is no such cache in torch: a freed tensor goes back to the C allocator, and a large one
(glibc: over its mmap threshold) straight back to the system, so the process's resident memory falls.
"""

from __future__ import annotations

import gc
import os
import resource

import torch

from parallel.world.devices import cuda_memory, empty_cache

MiB = 2**20


def rss_bytes() -> int:
    """This process's resident memory now (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def system_memory() -> dict[str, int]:
    """Total and available memory of the machine, from /proc/meminfo (kB there)."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable"):
                info[key] = int(value.split()[0]) * 1024
    return {"total": info["MemTotal"], "available": info["MemAvailable"]}


def stats(device: torch.device) -> dict[str, int]:
    """Bytes by kind. CUDA: allocated (live tensors), reserved (held by the caching allocator), peak
    allocated, and the device's total and free. CPU: this process's resident and peak resident memory,
    and the machine's total and available."""
    if device.type == "cuda":
        return cuda_memory(device)
    system = system_memory()
    return {"resident": rss_bytes(), "peak_resident": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "total": system["total"], "available": system["available"]}


def empty_cache_demo(device: torch.device, mib: int = 256) -> list[tuple[str, dict[str, int]]]:
    """Allocate `mib` MiB, free it, empty the cache; the memory figures after each stage."""
    out = [("start", stats(device))]
    x = torch.ones(mib * MiB // 4, device=device)  # ones, not empty: the pages are touched, so they count
    out.append((f"after torch.ones({mib} MiB)", stats(device)))
    del x
    gc.collect()
    out.append(("after del", stats(device)))
    if device.type == "cuda":
        empty_cache()
        out.append(("after torch.cuda.empty_cache()", stats(device)))
    return out
