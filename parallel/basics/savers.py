"""Fitting more into memory: mixed precision, activation checkpointing, and the largest batch that fits.

    python -m parallel bench memory [--workload transformer] [--batch-size 128] [--budget-mb 256]

Modes, each the same model, data and seed:
    fp32            the baseline
    autocast        CPU: bfloat16 autocast (fp32's exponent range, so no loss scaling);
                    CUDA: float16 autocast with GradScaler (fp16 gradients underflow without scaling)
    checkpointing   torch.utils.checkpoint over the model's layers in 2 segments: activations inside a
                    segment are dropped after forward and recomputed in backward (compute for memory)
    both            autocast inside checkpointed segments

Memory of one training step: on CUDA, torch.cuda.max_memory_allocated (every live tensor); on CPU, the
model state (parameters, momentum) plus the peak of what the step allocates, from torch.profiler's
allocator events (profile_memory=True): torch has no CPU allocator statistics of its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint_sequential

from parallel.basics import implausible
from parallel.kit.tensors import state_bytes
from parallel.loop.timing import StepTimer, summarize
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS
from parallel.world.devices import activate, empty_cache, peak_memory, reset_peak_memory, synchronizer
from parallel.world.errors import ConfigError

MODES = {"fp32": (False, False), "autocast": (True, False), "checkpointing": (False, True), "both": (True, True)}
SEGMENTS = 2


class Trainer:
    """One model trained in one mode. The CPU/GPU differences are chosen here, once."""

    def __init__(self, workload: str, mode: str, device: torch.device, lr: float = 0.3, seed: int = 0):
        self.workload, self.device = WORKLOADS[workload], device
        amp, self.checkpointing = MODES[mode]
        model = self.workload.build_model(seed).to(device)
        self.layers = nn.Sequential(*model.pipeline_layers())  # the same parameters, as one sequence
        self.optimizer = torch.optim.SGD(self.layers.parameters(), lr=lr, momentum=0.9)
        dtype = torch.float16 if device.type == "cuda" else torch.bfloat16
        self.autocast = (lambda: torch.autocast(device.type, dtype=dtype)) if amp else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler("cuda", enabled=amp and device.type == "cuda")
        self.dtype = str(dtype).removeprefix("torch.") if amp else "float32"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        with self.autocast():
            if self.checkpointing:
                out = checkpoint_sequential(self.layers, SEGMENTS, x, use_reentrant=False)
            else:
                out = self.layers(x)
            loss = self.workload.loss(out.float(), y)
        self.scaler.scale(loss).backward()  # scaling is a no-op when disabled (CPU, or fp32)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return loss.detach()

    def state_bytes(self) -> int:
        return state_bytes(list(self.layers.parameters()), self.optimizer)


def step_memory(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes one training step needs at its peak (see the module docstring for how, per device)."""
    trainer.step(x, y)  # warm: momentum buffers exist, as in a long run
    if trainer.device.type == "cuda":
        sync = synchronizer(trainer.device)
        sync()
        reset_peak_memory([trainer.device])
        trainer.step(x, y)
        sync()
        return peak_memory([trainer.device])[0][0]
    with _stderr_silenced(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.step(x, y)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:  # allocations are positive, frees negative: the running sum is what the step holds
        live += e.nbytes()
        peak = max(peak, live)
    return trainer.state_bytes() + peak


@contextlib.contextmanager
def _stderr_silenced():
    """Kineto prints two lines to the process's stderr each time a profiler starts and stops, whatever
    KINETO_LOG_LEVEL says; dozens of probes would bury the table. Python exceptions still propagate."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def largest_batch(memory_at: Callable[[int], int | None], budget: int, start: int = 8,
                  cap: int = 1 << 16) -> tuple[int, int | None]:
    """(the largest batch whose memory_at(batch) fits `budget`, the bytes measured for it). None from
    memory_at means it did not fit (e.g. out of memory). Doubles until a batch does not fit, then bisects.
    (0, None) if not even `start` fits; `cap` if everything up to it does. Assumes memory grows with the
    batch, as it does for a training step. The bytes are the probe's own: a repeat measurement of the same
    step varied by up to 3% here (allocation order), so a re-measured boundary batch may not fit again."""
    measured: dict[int, int | None] = {}

    def fits(b: int) -> bool:
        measured[b] = memory_at(b)
        return measured[b] is not None and measured[b] <= budget

    if not fits(start):
        return 0, None
    lo = start
    while lo < cap and fits(min(2 * lo, cap)):
        lo = min(2 * lo, cap)
    hi = min(2 * lo, cap)  # lo fits, hi does not (unless lo == cap)
    while hi - lo > max(1, lo // 32):  # to within 3%: each probe is a real training step
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, measured[lo]


@dataclass
class Result:
    mode: str
    dtype: str
    step_ms: dict
    memory_bytes: int
    loss_after: float  # training loss after `steps` steps from the same start: what the mode does to training
    largest_batch: int | None = None
    largest_batch_bytes: int | None = None
    others_cpu: float | None = None  # share of the CPU other processes used while step_ms was timed (load.py)


def run(workload: str, device: torch.device, batch: int, budget: int | None, steps: int = 5, repeats: int = 5,
        progress: Callable[[str], None] = lambda s: None) -> list[Result]:
    if WORKLOADS[workload].multi_part:
        raise ConfigError(f"the memory savers train one model; {workload} has several")
    activate([device])  # CUDA initialised before its memory statistics are read
    data = SyntheticData(WORKLOADS[workload], 0, batch)
    results = []
    for mode in MODES:
        progress(f"{mode}: training {steps} steps")
        trainer = Trainer(workload, mode, device)
        for s in range(steps):
            loss = trainer.step(*(t.to(device) for t in data.batch(s)))
        x, y = (t.to(device) for t in data.batch(steps))
        timer, times, watch = StepTimer(synchronizer(device)), [], implausible.Watch()
        for _ in range(repeats):
            with timer:
                trainer.step(x, y)
            times.append(timer.elapsed)
        others = watch.stop()
        r = Result(mode, trainer.dtype, summarize(times), step_memory(trainer, x, y), loss.item(), others_cpu=others)
        if budget:
            progress(f"{mode}: largest batch within {budget / 2**20:.0f} MiB")
            r.largest_batch, r.largest_batch_bytes = largest_batch(
                lambda b, m=mode: _memory_or_none(workload, m, device, b), budget)
        results.append(r)
    return results


def _memory_or_none(workload: str, mode: str, device: torch.device, batch: int) -> int | None:
    x, y = (t.to(device) for t in SyntheticData(WORKLOADS[workload], 0, batch).batch(0))  # any size: made to fit
    try:
        return step_memory(Trainer(workload, mode, device), x, y)
    except torch.OutOfMemoryError:
        empty_cache()
        return None
