"""The sharded family's textbook and cost model: bytes a rank sends per step, the step predicted from the
calibration, and the collectives timed alone in a run."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as td
from torch import nn

from parallel.kit.collectives import all_gather, rank0_says, reduce_scatter
from parallel.kit.tensors import param_bytes
from parallel.loop.results import Measured
from parallel.loop.timing import StepTimer, summarize
from parallel.measure.formulas import wire_bytes
from parallel.world.devices import synchronizer


def ring_allreduce_bytes(payload_bytes: float, world: int) -> float:
    """Bytes each rank sends to all-reduce `payload_bytes` with a ring: reduce-scatter then all-gather,
    each moving (N-1)/N of the payload (the nccl-tests busbw convention; the planner's formulas.wire_bytes)."""
    return wire_bytes("all_reduce", payload_bytes, world)


def grad_bytes(model: nn.Module) -> int:
    return param_bytes(p for p in model.parameters() if p.requires_grad)


def allreduce_every_gradient(model: nn.Module, config) -> float:
    """Data parallel's textbook bytes a rank sends per step (ddp, manual_ddp): every gradient all-reduced
    once, with a ring."""
    return ring_allreduce_bytes(grad_bytes(model), config.world_size)


def predict_data_parallel_ms(cal, config, accum: int) -> float | None:
    """Data parallel (ddp, manual_ddp): each rank computes its share (in `accum` pieces) and all-reduces
    every gradient once a step.
    - gloo on CPU: the all-reduce cannot hide behind compute (the ranks' threads already use every
      core), so it is added whole.
    - nccl: the buckets all-reduce on their own stream while backward goes on, so only what outlasts the
      last micro-batch's backward shows (backward is about two thirds of a step's arithmetic, twice the
      forward's), and never less than the last bucket's all-reduce, which starts when backward ends
      (the first layers' bucket; DDP's is 1 MiB)."""
    n = config.world_size
    comm = cal.allreduce_ms(cal.grad_bytes, n)
    if comm is None:
        return None
    micro = cal.compute_ms(config.batch_size // (n * accum))
    if not cal.overlaps:
        return accum * micro + comm
    return accum * micro + max(comm - 2 / 3 * micro, cal.allreduce_ms(min(cal.grad_bytes, 2**20), n))


def predict_sharded_ms(cal, config, row, all_gathers: int) -> float | None:
    """Sharded data parallel (zero, fsdp): each rank computes its share, then one reduce-scatter of the
    gradients and `all_gathers` all-gathers of the parameters, none hidden (they block in or after
    backward here; FSDP2's prefetch on GPUs would hide some: an upper bound there). The collectives' times
    are the row's own, measured in this run (timed_collectives: on gloo a reduce-scatter costs about
    an all-reduce); without them, from the all-reduce calibration: an all-gather or an nccl reduce-scatter
    is half an all-reduce's traffic, gloo's reduce-scatter a whole one (PR #118911)."""
    m, n = row.measured, config.world_size
    if m.reduce_scatter_all_grads_ms is not None and m.all_gather_all_params_ms is not None:
        comm = m.reduce_scatter_all_grads_ms + all_gathers * m.all_gather_all_params_ms
    else:
        allreduce = cal.allreduce_ms(cal.grad_bytes, n)
        if allreduce is None:
            return None
        comm = (allreduce / 2 if cal.overlaps else allreduce) + all_gathers * allreduce / 2
    return cal.compute_ms(config.batch_size // n) + comm


COLLECTIVES_BUDGET_S = 4.0  # seconds the timed rounds may take: every round on small models; at GPT-2
# small's 92M parameters over gloo a round took about 2 s, and 4 of them were most of zero's extras


def timed_rounds(work: dict[str, Callable[[int], object]], rounds: int, budget_s: float,
                 device: torch.device) -> dict[str, float]:
    """Median ms of each of `work`'s callables (given the round's number), timed in turns round by round so
    that a drift of the machine's speed hits all alike. The first round warms up and is dropped, unless it
    alone spent `budget_s`: work of seconds is warm from the first (median_time's rule). The rounds stop
    once `budget_s` is spent, as rank 0 counts it (rank0_says), so that every rank times the same rounds."""
    timer, times, spent = StepTimer(synchronizer(device)), {k: [] for k in work}, 0.0
    for i in range(rounds + 1):
        for kind, run in work.items():
            with timer:
                run(i)
            spent += timer.elapsed
            times[kind].append(timer.elapsed)
        if rank0_says(spent > budget_s, device):
            break
        if not i:
            times = {k: [] for k in work}
    return {k: summarize(v)["p50_ms"] for k, v in times.items()}


def timed_collectives(device: torch.device, numel: int, rounds: int = 10) -> dict[str, float]:
    """Median ms of one all-reduce, one reduce-scatter and one all-gather of `numel` fp32 elements (padded
    to a multiple of N) over the world, timed in turns (timed_rounds, within COLLECTIVES_BUDGET_S): what
    each costs here, in one run."""
    n = td.get_world_size()
    whole = torch.zeros(-(-numel // n) * n, device=device)
    part = torch.zeros(whole.numel() // n, device=device)
    work = {"all_reduce": lambda i: td.all_reduce(whole), "reduce_scatter": lambda i: reduce_scatter(part, whole),
            "all_gather": lambda i: all_gather(whole, part)}
    return timed_rounds(work, rounds, COLLECTIVES_BUDGET_S, device)


def measured_collectives(device: torch.device, numel: int, rounds: int) -> Measured:
    """timed_collectives as the row's declared measurements (the report's CPU caveat and the cost model
    read them)."""
    ms = timed_collectives(device, numel, rounds)
    return Measured(allreduce_all_grads_ms=ms["all_reduce"], reduce_scatter_all_grads_ms=ms["reduce_scatter"],
                    all_gather_all_params_ms=ms["all_gather"])
