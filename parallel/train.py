"""THE training loop. Every strategy runs through it; none has a loop of its own.

    for each of warmup + steps optimiser steps:
        batch  = this rank's share of global batch `step`   (same data everywhere, same seed)
        [sync, clock] strategy.train_step(...) [sync, clock]   <- only steps after the warm-up are timed
        profiler.step()
    losses are all-reduced across ranks once, at the end, and checked for NaN/inf
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from parallel.devices import synchronizer
from parallel.harness.timing import StepTimer


@dataclass
class TrainResult:
    losses: list[float]  # the global loss of every step, warm-up included
    step_s: list[float]  # seconds of each timed step (warm-up excluded)
    timed: tuple[float, float] = (0.0, 0.0)  # perf_counter at the start of the first timed step and the end
    #                                          of the last (CLOCK_MONOTONIC: comparable across processes)
    samples_per_s: float | None = None  # set where it is not global batch / median step (Hogwild)


class NonFiniteLoss(RuntimeError):
    pass


class InjectedFault(RuntimeError):
    """Raised on purpose (--fail-at-step), to show and test what a crashed rank looks like."""


def train(strategy, trainable, data, config, dist, profiler=None) -> TrainResult:
    timer = StepTimer(synchronizer(dist.device))
    losses, step_s, first = [], [], None
    for step in range(config.warmup + config.steps):
        batch = data.batch(step, dist.rank, dist.world_size)
        if step == config.fail_at_step and dist.rank == config.fail_rank:
            raise InjectedFault(f"injected fault at step {step} on rank {dist.rank} (--fail-at-step)")
        with timer, record_function(f"step {step}"):
            loss = strategy.train_step(trainable, batch, dist)
        losses.append(loss.detach().float().reshape(()))
        if step >= config.warmup:
            step_s.append(timer.elapsed)
            first = timer.started if first is None else first
        if profiler is not None:
            profiler.step()
    # One all-reduce for the whole run, off the clock: each rank's loss is the mean over its equal share.
    global_losses = dist.all_reduce_mean(torch.stack(losses).cpu()).tolist()
    for step, value in enumerate(global_losses):
        if not math.isfinite(value):
            raise NonFiniteLoss(f"loss is {value} at step {step} of {strategy.name}")
    return TrainResult(global_losses, step_s, (first or timer.started, timer.started + timer.elapsed))
