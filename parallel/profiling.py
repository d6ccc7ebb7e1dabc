"""torch.profiler around the training loop: a short schedule, one trace per strategy per rank.

Traces go to <out>/tb/<strategy>/ named `<strategy>_rank<R>`, so ranks never overwrite each other
(torchtitan's habit), and TensorBoard's profiler plugin (torch-tb-profiler) opens them:
`tensorboard --logdir <out>/tb`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


class _Off(contextlib.nullcontext):
    def step(self) -> None:
        pass


def make_profiler(enabled: bool, out: str, strategy: str, rank: int, device: torch.device):
    """A profiler with `.step()`, or a stand-in that does nothing when profiling is off."""
    if not enabled:
        return _Off()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_dir = Path(out) / "tb" / strategy
    trace_dir.mkdir(parents=True, exist_ok=True)
    return profile(
        activities=activities,
        # skip one step (start-up effects), warm the profiler up for one, record three: small traces.
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"{strategy}_rank{rank}"),
        profile_memory=True,
        record_shapes=False,
    )
