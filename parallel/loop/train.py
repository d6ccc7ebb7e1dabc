"""THE training loop. Every strategy runs through it; none has a loop of its own.

    for each of warmup + steps optimiser steps:
        batch  = this rank's share of global batch `step`   (its dp coordinate's share: strategy.dims)
        [sync, clock] strategy.train_step(...) [sync, clock]   <- only steps after the warm-up are timed
                      (its optimizer.step() clips by the global gradient norm, then schedules: clipping.py)
                      (under --precision: fp32, or bf16 autocast; the warm-up steps' collectives counted)
        profiler.step()
        [--check-replicas] what ranks must hold alike, checksummed and compared   (divergence.py)
    losses are averaged over the ranks whose loss counts, once, at the end, and checked for NaN/inf
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as td
from torch.autograd.profiler import record_function

from parallel.loop import checkpoint, divergence, faults, recorder, tokens, wire
from parallel.loop.clipping import Step
from parallel.loop.optim import make_optimizer
from parallel.loop.timing import StepTimer
from parallel.world.devices import IntervalClock, memory_history, synchronizer_all
from parallel.world.dist import watch_group
from parallel.world.errors import ConfigError


@dataclass
class TrainResult:
    losses: list[float]  # the global loss of every step, warm-up included (the first, for several losses)
    step_s: list[float]  # seconds of each timed step (warm-up excluded)
    timed: tuple[float, float] = (0.0, 0.0)  # perf_counter at the start of the first timed step and the end
    #                                          of the last (CLOCK_MONOTONIC: comparable across processes)
    samples_per_s: float | None = None  # set where it is not global batch / median step (Hogwild)
    loss_parts: list[list[float]] | None = None  # every loss of every step, when a step has several (the DCGAN's)
    wire: wire.Counter = field(default_factory=lambda: wire.Counter(0))  # the collectives (and copies between
    #                                         devices) of the counted steps; none for a loop of its own (Hogwild)
    diverged: str = ""  # --check-replicas: the first step, tensor and ranks whose copies differed ("": none)
    checked: int | None = None  # ... and the steps in which it compared something (None: not checked)
    grad_norms: dict[str, list[float]] = field(default_factory=dict)  # --clip-norm: each optimiser's global
    #   gradient norm before the clip, every step (one optimiser: key ""; the DCGAN's: by part)
    norm_reduced: bool = False  # ... all-reduced over the ranks each step (loop/clipping.py)
    update_s: list[float] = field(default_factory=list)  # the optimiser's update alone, each timed step


@contextlib.contextmanager
def default_dtype(config):
    """--precision fp64: every floating tensor made without a dtype is float64 while the run is built and
    trained (torch.set_default_dtype): the model's parameters, its data and every buffer a strategy makes.
    Rounding is then 2^29 times finer than fp32's, too fine to flip a ReLU's or a max-pool's decision, so a
    difference from `single` is a bug (docs/oracle.md). Restored after, for the next run in the process."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64 if config.precision == "fp64" else before)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def precision(config, device: torch.device):
    """The arithmetic of every step, one substitution for every strategy: under "bf16", torch.autocast to
    bfloat16 on the device's type (matrix products and convolutions in bf16, losses and reductions in fp32;
    parameters, gradients and the optimiser's update stay fp32, as they are no autocast ops); under "fp32",
    nothing. Threads a strategy starts carry it along (primitives.DeviceThreads)."""
    if config.precision in ("bf16", "bf16-master"):  # bf16-master: bf16 weights too (loop/master.py)
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


_LOSS = {"fp32": torch.float32, "bf16": torch.float32, "bf16-master": torch.float32,  # a step's loss as recorded
         "fp64": torch.float64}


class NonFiniteLoss(RuntimeError):
    pass


def train(strategy, trainable, data, config, dist, profiler=None) -> TrainResult:
    timer = StepTimer(synchronizer_all(trainable.all_devices() if trainable is not None else [dist.device]))
    device = trainable.device if trainable is not None else dist.device
    losses, step_s, first = [], [], None
    total = config.warmup + config.steps
    dims = strategy.dims(config, dist)  # which share of each global batch this rank takes, whose loss counts
    stepped = trainable is not None and trainable.optimizer is not None  # an optimiser whose update is timed
    clock = IntervalClock(trainable.all_devices() if stepped else [])
    clip = Step(trainable, make_optimizer(config), dims, dist, clock)  # the clip, the schedule, the update's time
    start = checkpoint.resume_point(config, strategy, trainable)
    clip.resume(start)
    share = dims.batch_share(dist.rank)
    snapshot = snapshot_path(strategy, config, dist)
    # Bytes on the wire, counted in the warm-up steps (off the clock), per block for tensor parallelism; with
    # no warm-up (a CPU step of seconds), in the first step alone, whose time the report's note then shows
    per_block = trainable is not None and getattr(strategy, "TENSOR_PARALLEL", False)  # Megatron counts per block
    counter = wire.Counter(max(1, config.warmup), trainable.model if per_block else None)
    replicas = divergence.Check(config, dims, dist, trainable)  # --check-replicas, between steps (off the clock)
    for step in range(start, total):
        batch = data.batch(step, *share)
        weighs = trainable is not None and hasattr(trainable.loss_fn, "weigh")  # uneven tokens (loop/tokens.py)
        recorder.mark(step, f"step {step}: in the watchdog's barrier before it")
        faults.check(step, config, dist)
        _watchdog(config, dist)
        recorder.mark(step, f"step {step}: in its train_step")
        hang = faults.around_step(step, config, dist)  # --hang-rank's stop, inside the step
        with counter.step(), memory_history(device, snapshot if step == max(0, config.warmup - 1) else None), \
                timer, record_function(f"step {step}"), precision(config, device), hang:
            if weighs:  # the step's share of the global token mean: counted, or all-reduced where ranks read apart
                trainable.loss_fn.weigh(tokens.density(data, step, batch[1], share[1], dist))
            clip.start_step()
            loss = strategy.train_step(trainable, batch, dist)
        clip.end_step()  # the timer synchronized at the step's end: the update's events are done
        losses.append(loss.detach().to(_LOSS[config.precision]).reshape(-1))  # (1,), or (k,) for k losses
        if step >= config.warmup:
            step_s.append(timer.elapsed)
            first = timer.started if first is None else first
        replicas.after(step, loss)
        if profiler is not None:
            profiler.step()
        if config.checkpoint_every and ((step + 1) % config.checkpoint_every == 0 or step == total - 1):
            checkpoint.save(config, strategy, trainable, step, dist)
    replicas.close()
    clip.close()
    # One all-reduce for the whole run, off the clock: the mean over the ranks whose loss counts (each the
    # mean over its equal share; one per tensor-parallel group, the last pipeline stage).
    recorder.mark(-1, "after the last step: in the all-reduce of the losses")
    counts = dims.counts_loss(dist.rank)
    global_losses = dist.all_reduce_mean(torch.stack(losses).cpu(), counts).tolist() if losses else []  # (steps, k)
    for step, values in enumerate(global_losses):
        if not all(map(math.isfinite, values)):
            raise NonFiniteLoss(f"loss is {values if len(values) > 1 else values[0]} at step {step} of {strategy.name}")
    several = bool(global_losses) and len(global_losses[0]) > 1
    return TrainResult([v[0] for v in global_losses], step_s, (first or timer.started, timer.started + timer.elapsed),
                       loss_parts=global_losses if several else None, wire=counter, diverged=replicas.found,
                       checked=replicas.checked, grad_norms=clip.norms(), norm_reduced=clip.reduces and clip.clips,
                       update_s=clip.timed(len(step_s)))


def snapshot_path(strategy, config, dist) -> str | None:
    """Where --memory-snapshot puts this rank's allocator history: OUT/memory/STRATEGY-rankR.pickle, the
    last warm-up step's (untimed; the first step where there is no warm-up), or None."""
    if config.memory_snapshot != strategy.name or not config.out:
        return None
    folder = Path(config.out) / "memory"
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / f"{strategy.name}-rank{dist.rank}.pickle")


def step_lines(losses: list[float], step_ms: list[float], warmup: int, steps: int,
               loss_parts: dict[str, list[float]] | None = None) -> list[str]:
    """One log line per optimiser step, in torchtitan's manner, from what the loop recorded (after it, so
    that nothing is printed, read or synchronized inside a timed step):

        warmup 1/3  loss 2.3026
        step 3/20  loss 2.2750  ms 33.2

    `losses`: the global loss of every step run (warm-up first; fewer after a resume: the last ones);
    `step_ms`: the timed steps' milliseconds, or several workers' runs of them one after another (Hogwild:
    its workers' steps, worker-major), shown as their mean a step; `loss_parts`: each loss of a step
    that has several, by name (the DCGAN's d_loss, g_loss)."""
    total = warmup + steps
    first = total - len(losses)  # the step a resumed run started at
    timed = total - max(first, warmup)
    per_step = [step_ms] if timed and len(step_ms) == timed else \
        [step_ms[i:i + timed] for i in range(0, len(step_ms), timed)] if timed and len(step_ms) % timed == 0 else []
    lines = []
    for i, loss in enumerate(losses):
        step = first + i
        head = f"warmup {step + 1}/{warmup}" if step < warmup else f"step {step - warmup + 1}/{steps}"
        parts = "".join(f"  {name} {values[i]:.4f}" for name, values in (loss_parts or {}).items() if i < len(values))
        j = step - max(first, warmup)
        ms = f"  ms {sum(w[j] for w in per_step) / len(per_step):.1f}" if step >= warmup and per_step else ""
        lines.append(f"{head}  loss {loss:.4f}{parts}{ms}")
    return lines


def start_line(strategy, config, dist) -> str:
    """The log's first line: which run this is (a torchrun restart prints it again, with its attempt)."""
    world = strategy.world_size(config)
    try:
        used = config.spec.first(world)  # `single` on cpu:2 uses one of them
    except ConfigError:
        used = config.spec
    launch = f"torchrun, {config.spec.backend}" if strategy.launch == "torchrun" else strategy.launch
    attempt = f", restart {dist.restart}" if dist.restart else ""
    return (f"run {strategy.name}: world size {world} ({launch}{attempt}) on {used} ({strategy.kind(config)}), "
            f"workload {config.workload}, global batch {config.batch_size}, {config.warmup} warm-up + "
            f"{config.steps} steps, {config.precision}, seed {config.seed}")


def end_line(row) -> str:
    """The log's last line: the final loss and the step time's median (p95), throughput."""
    ms = f"  p50 ms {row.step_ms_p50:.1f}  p95 ms {row.step_ms_p95:.1f}" if row.step_ms_p50 is not None else ""
    speed = f"  samples/s {row.samples_per_s:,.0f}" if row.samples_per_s else ""
    loss = f"{row.final_loss:.4f}" if row.final_loss is not None else "-"
    return f"done {row.strategy}: final loss {loss}{ms}{speed}"


def _watchdog(config, dist) -> None:
    """Before each step of a multi-process run, all ranks meet at a monitored barrier: a rank that does not
    arrive within --pg-timeout is named in the error ("Rank 1 failed to pass monitoredBarrier in 5000 ms")
    instead of a collective failing anonymously (or, without a timeout, hanging for gloo's default 30
    minutes). Off the clock. nccl has no monitored_barrier: there it runs on a gloo group of the same ranks
    (dist.watch_group)."""
    if dist.world_size > 1 and (group := watch_group(config.pg_timeout)) is not None:
        td.monitored_barrier(group=group, timeout=timedelta(seconds=config.pg_timeout), wait_all_ranks=True)
