"""Faults on purpose, to show and test what a crashed or hung rank looks like (--fail-at-step, --hang-rank).

Only in torchrun's first attempt, so that a restarted group can show that it recovers.

--hang-rank R: rank R stops inside step 1 where a real hang stops a rank (--hang-how kill: is killed there by
SIGKILL, as an out-of-memory kill would), at its first gradient
collective: the first reducing collective, send or receive it would issue once the step's backward has
begun (DDP's bucket all-reduce, FSDP's reduce-scatter, a pipeline's gradient send or receive; in a pipeline whose
schedule interleaves, possibly the next micro-batch's forward send). It never issues it, and the other
ranks go on into that collective and wait there; their diagnosis names it (judge/hangs.py). A step
with no collective after backward stops at its end. A TorchDispatchMode sees each operation as it is issued:
a collective is one of torch.distributed's ops (wire.NAMESPACES), the waits and barriers aside.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from parallel.loop import recorder, wire


class InjectedFault(RuntimeError):
    """Raised on purpose (--fail-at-step), to show and test what a crashed rank looks like."""


HANG_STEP = 1
# A gradient collective: one that reduces (an all-reduce of DDP's bucket, FSDP's reduce-scatter; not the
# all-gather FSDP runs in backward to have a block's weights again), or a send or a receive in backward (a
# pipeline's: its first stage sends nothing back, and receives its next micro-batch's gradient).
_GRADIENT = ("allreduce", "all_reduce", "reduce_scatter", "send", "recv", "batch_p2p")


def check(step: int, config, dist) -> None:
    """Before each step: --fail-at-step raises on its rank and step."""
    if not dist.restart and step == config.fail_at_step and dist.rank == config.fail_rank:
        raise InjectedFault(f"injected fault at step {step} on rank {dist.rank} (--fail-at-step)")


def around_step(step: int, config, dist):
    """Inside each step: on --hang-rank's rank at step 1, the stop at its first gradient collective; not in a
    run of one process (a comparison's baseline), where no other rank would wait for it."""
    if dist.restart or step != HANG_STEP or dist.rank != config.hang_rank or dist.world_size < 2:
        return contextlib.nullcontext()
    return _Hang(step, config.hang_how == "kill")


def stop(why: str, kill: bool = False) -> None:
    recorder.mark(-1, why)
    if kill:  # as the kernel's OOM killer or a scheduler would: no handler runs, no record is written
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(24 * 3600)  # stop responding: the others' collectives time out, and their diagnosis names this rank


class _Hang(TorchDispatchMode):
    def __init__(self, step: int, kill: bool = False):
        super().__init__()
        self.step, self.backward, self.kill = step, False, kill

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            return NotImplemented  # a DTensor first: the collectives its dispatch runs come through here
        self.backward = self.backward or torch._C._current_graph_task_id() != -1
        name = func._schema.name.split("::")[-1]
        if self.backward and func.namespace in wire.NAMESPACES and any(g in name for g in _GRADIENT):
            stop(f"step {self.step}: stopped by --hang-rank before its first gradient collective ({name})", self.kill)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        if exc[0] is None:  # no collective after backward began: stop at the step's end
            stop(f"step {self.step}: stopped by --hang-rank at the end of the step (no gradient collective seen)",
                 self.kill)
        return out
