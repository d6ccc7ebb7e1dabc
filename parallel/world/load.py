"""Was the machine quiet while a row was measured? CPU time that processes other than this run's own used
during each strategy's child, and, on GPUs, other processes computing on the run's GPUs.

    watch = ForeignLoad(gpus=[0, 1]); ... run the child ...; share, gpu_pids = watch.stop()

CPU: the machine's busy time (psutil: user, nice, system, interrupts, and time stolen by a hypervisor)
over the child's run, minus this process's own and that of its reaped descendants (os.times: the child,
torchrun, its workers), as a share of the machine's capacity (wall time x cores). The child is reaped by
then, so its time counts as ours; whatever is left is somebody else's. GPUs: NVML's compute processes on
the run's GPUs at the start and at the end, minus this run's process tree.
"""

from __future__ import annotations

import os
import time

import psutil

from parallel.world import machine

NOISY = 0.10  # a row measured while other processes used more than this share of the machine is "noisy"


def _busy() -> float:
    t = psutil.cpu_times()
    return sum(getattr(t, f, 0.0) for f in ("user", "nice", "system", "irq", "softirq", "steal"))


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _foreign_gpu(gpus: list[int]) -> set[int]:
    pids = machine.gpu_process_ids(gpus) or set()
    me = psutil.Process()
    own = {me.pid, *(c.pid for c in me.children(recursive=True))}
    return pids - own


class ForeignLoad:
    def __init__(self, gpus: list[int] | None = None):
        self.gpus = gpus or []
        self._t0, self._busy0, self._own0 = time.monotonic(), _busy(), _own()
        self._gpu0 = _foreign_gpu(self.gpus) if self.gpus else set()

    def stop(self) -> tuple[float, list[int]]:
        """(share of the machine's CPU capacity other processes used, pids of others on the GPUs)."""
        wall = time.monotonic() - self._t0
        foreign = (_busy() - self._busy0) - (_own() - self._own0)
        share = max(0.0, foreign) / (wall * (psutil.cpu_count() or 1)) if wall > 0 else 0.0
        gpu = sorted(self._gpu0 | (_foreign_gpu(self.gpus) if self.gpus else set()))
        return share, gpu
