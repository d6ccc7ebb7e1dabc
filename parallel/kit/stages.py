"""What model parallelism and its pipelined form share: cutting a model into K contiguous stages, one
per device, balanced by measured time (or by parameter count), and counting what each stage holds.

    layers:   [conv1 relu pool conv2 relu pool flatten | fc1 relu fc2 relu fc3]
    stages:    stage 0 on device 0                     | stage 1 on device 1
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.kit.saved import ActivationMeter
from parallel.kit.tensors import param_bytes
from parallel.kit.tied import sum_tied, untie
from parallel.loop import wire
from parallel.loop.timing import median_time
from parallel.world.devices import synchronizer_all
from parallel.world.errors import ConfigError

PIECE_BUDGET_S = 1.0  # seconds one layer's or stage's timing may take: all `reps` on toy models, fewer at real sizes


def layers_of(model: nn.Module) -> list[nn.Module]:
    if not hasattr(model, "pipeline_layers"):
        raise ConfigError(f"{type(model).__name__} does not say how to split it (no pipeline_layers())")
    return model.pipeline_layers()


def measure_layers(layers: list[nn.Module], x: torch.Tensor, devices: list[torch.device], reps: int = 5,
                   hop: Callable[[torch.Tensor], float] | None = None) -> tuple[list[float], list[float]]:
    """(seconds of forward + backward of each layer alone on its real input, seconds to move its output to
    the next device and the gradient back), medians of `reps`, measured where the stages will run: each
    layer on devices[0] (a node's devices are alike; a copy of the layer, so the model stays where it is
    and no device needs to hold all of it), and the move as the real copy devices[0] -> devices[1] and
    back, or as `hop(output)` says where the stages move it otherwise (pipeline_dist: SentHop). The first
    layer's input needs no gradient, as in training (for conv1 that gradient would be most of the cost)."""
    home, other = devices[0], devices[1 % len(devices)]
    sync = synchronizer_all([home, other])
    x = x.to(home)
    costs, moves = [], []
    for i, layer in enumerate(layers):
        here = copy.deepcopy(layer).to(home)
        a = x.detach().requires_grad_(i > 0)
        costs.append(median_time(functools.partial(_fwd_bwd, here, a), reps, sync, PIECE_BUDGET_S))  # synced
        x = here(a).detach()
        moves.append(hop(x) if hop is not None else
                     median_time(functools.partial(_copy_there_and_back, x, other, home), reps, sync,
                                 PIECE_BUDGET_S))
        del here
    return costs, moves


def _fwd_bwd(layer: nn.Module, a: torch.Tensor) -> None:
    y = layer(a)
    y.backward(torch.ones_like(y))


def _copy_there_and_back(x: torch.Tensor, there: torch.device, back: torch.device) -> None:
    x.to(there, copy=True).to(back, copy=True)  # the activation to the next stage, and (same size) its gradient back


class SentHop:
    """measure_layers' `hop` where the stages are processes (pipeline_dist): seconds to send an output's
    bytes to rank `peer` and receive as many back (its gradient), point to point over the default group as
    the schedules' isend/irecv, median of `reps` after a warm-up. `peer` runs SentHop.echo meanwhile, until
    this rank calls close()."""

    def __init__(self, peer: int, device: torch.device, reps: int = 5):
        self.peer, self.device, self.reps = peer, device, reps
        self.sync = synchronizer_all([device])

    def __call__(self, x: torch.Tensor) -> float:
        import torch.distributed as td

        there = x.detach().contiguous().reshape(-1).view(torch.uint8)
        back = torch.empty_like(there)
        td.send(torch.tensor([there.numel(), self.reps + 1], device=self.device), self.peer)  # what comes, how often
        return median_time(lambda: (td.send(there, self.peer), td.recv(back, self.peer)), self.reps, self.sync)

    def close(self) -> None:
        import torch.distributed as td

        td.send(torch.zeros(2, dtype=torch.int64, device=self.device), self.peer)  # no more: the echo returns

    @staticmethod
    def echo(peer: int, device: torch.device) -> None:
        """The other end: receive what rank `peer`'s SentHop sends and send it back, until it says no more."""
        import torch.distributed as td

        while True:
            header = torch.zeros(2, dtype=torch.int64, device=device)
            td.recv(header, peer)
            nbytes, times = header.tolist()
            if not nbytes:
                return
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
            for _ in range(times):
                td.recv(buf, peer)
                td.send(buf, peer)


def check_layers(run) -> None:
    """model_parallel's and pipeline's check: a stage per device needs as many layers, refused at planning
    with the reason (not at the first step), from the model's shapes alone (shape_model)."""
    if run.world_size > (n := len(layers_of(run.meta_model))):
        raise ConfigError(f"{run.world_size} stages (one a device), but the {run.model or run.config.workload} "
                          f"has {n} layers to split")


def partition(costs: list[float], k: int, moves: list[float] | None = None,
              holds: list[bool] | None = None) -> list[int]:
    """Bounds [0, ..., n] of the contiguous split into k parts with the smallest largest part (exact, by
    dynamic programming over prefix sums): part i is costs[bounds[i]:bounds[i+1]], plus, for a part that
    starts at layer a > 0, moves[a-1]: what bringing its input over (and the gradient back) costs.
    `holds[i]`: layer i has parameters; where at least k layers do, every part gets one (a stage of
    ReLUs and pooling alone has nothing to train, and its process no optimiser: pipeline_dist failed so
    on the CNN over 3 ranks, when the measured times happened to put one there)."""
    n = len(costs)
    if not 1 <= k <= n:
        raise ConfigError(f"cannot split {n} layers into {k} stages")
    moves = moves or [0.0] * n
    prefix, held = [0.0], [0]
    for c, h in zip(costs, holds or [True] * n, strict=True):
        prefix.append(prefix[-1] + c)
        held.append(held[-1] + bool(h))
    need = held[-1] >= k  # otherwise some part cannot hold any: cut by cost alone

    def part(a: int, b: int) -> float:
        if need and held[b] == held[a]:
            return math.inf
        return prefix[b] - prefix[a] + (moves[a - 1] if a else 0.0)

    best = {(0, 0): (0.0, [])}  # (parts, layers used) -> (largest part, cut points)
    for parts in range(1, k + 1):
        for used in range(parts, n - (k - parts) + 1):
            best[(parts, used)] = min(
                ((max(best[(parts - 1, cut)][0], part(cut, used)), best[(parts - 1, cut)][1] + [cut])
                 for cut in range(parts - 1, used) if (parts - 1, cut) in best), key=lambda v: v[0])
    return best[(k, n)][1] + [n]


@dataclass
class Split:
    stages: list[nn.Sequential]  # stage i lives on devices[i]; its layers are the model's own objects
    devices: list[torch.device]
    bounds: list[int]  # stage i = layers[bounds[i]:bounds[i+1]]
    balance: str
    tied: list[list[nn.Parameter]] = field(default_factory=list)  # untie()'s copies of each shared weight

    def sum_tied(self) -> None:
        """After backward: every copy of a tied weight gets the sum of their gradients (sum_tied)."""
        sum_tied(self.tied)

    def describe(self) -> str:
        return describe(self.bounds)

    def param_bytes(self) -> list[int]:
        return [param_bytes(s.parameters()) for s in self.stages]


def describe(bounds: list[int]) -> str:
    """Stage bounds as the report shows them: [0, 3, 12] -> "0-2 | 3-11" (layer indices)."""
    return " | ".join(f"{a}-{b - 1}" for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def given_cut(run, balance: str, k: int, layers: list[nn.Module]) -> list[int] | None:
    """The cut into k stages an earlier row of this run decided (RunConfig.cuts), if it fits these layers."""
    bounds = run.cuts.get(f"{balance}:{k}")
    return list(bounds) if bounds and len(bounds) == k + 1 and bounds[-1] == len(layers) else None


def cut(layers: list[nn.Module], k: int, balance: str, sample: torch.Tensor, devices: list[torch.device],
        hop: Callable[[torch.Tensor], float] | None = None) -> list[int]:
    """Bounds of the best contiguous cut of `layers` into k stages: by their forward + backward time on
    `sample` and the transfers between `devices` (or `hop`'s, measure_layers) ("time"), or by parameter
    count ("params")."""
    holds = [any(True for _ in layer.parameters()) for layer in layers]
    if balance == "time":
        costs, moves = measure_layers(layers, sample, devices, hop=hop)
        return partition(costs, k, moves, holds)
    return partition([float(sum(p.numel() for p in layer.parameters())) for layer in layers], k, holds=holds)


def agreed_cut(layers: list[nn.Module], k: int, balance: str, run, dist, micro_batch: int) -> list[int]:
    """`cut` where the stages are processes (pipeline_dist, fsdp_pp): decided on rank 0, by time measured at
    the micro-batch size or by parameters, and sent to every rank so that they all cut alike. By time, the
    hop between stages is priced as what those strategies do, not as a copy on rank 0's device: rank 0
    sends each layer's output to rank 1 and receives it back, point to point (SentHop; rank 1 echoes). A
    cut an earlier row of the run decided (config.cuts) is taken as it is, on every rank alike."""
    import torch.distributed as td


    if given := given_cut(run, balance, k, layers):
        return given
    decided, timed = [None], balance == "time"
    if dist.rank == 0:
        sample = run.workload.dataset(run.seed, micro_batch).batch(0)[0]
        hop = SentHop(1, dist.device) if timed else None
        decided = [cut(layers, k, balance, sample, [dist.device, dist.device], hop=hop)]
        if hop is not None:
            hop.close()
    elif dist.rank == 1 and timed:
        SentHop.echo(0, dist.device)
    td.broadcast_object_list(decided, src=0)
    return decided[0]


def split(model: nn.Module, devices: list[torch.device], balance: str, sample: torch.Tensor,
          bounds: list[int] | None = None) -> Split:
    """Cut `model` into len(devices) stages (at `bounds` where given) and move each to its device
    (parameters stay the model's own, so model.state_dict() still names and holds them)."""
    layers = layers_of(model)
    bounds = bounds or cut(layers, len(devices), balance, sample, devices)
    stages = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    tied = untie(stages)
    return Split([s.to(d) for s, d in zip(stages, devices, strict=True)], devices, bounds, balance, tied)


def measure_stages(layers: list[nn.Module], bounds: list[int], x: torch.Tensor, device: torch.device,
                   reps: int = 5) -> tuple[list[float], list[float]]:
    """(forward seconds, backward seconds) of each stage layers[bounds[i]:bounds[i+1]] on its real input,
    medians of `reps`, on `device` (copies of the layers): what a schedule's F and B cost on that stage,
    timed through the pipeline's own stage_forward and stage_backward (the copy between devices and the
    activation meter cost 20-25% of a CNN stage's bare forward here)."""
    sync = synchronizer_all([device])
    fwd, bwd = [], []
    for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        stage = copy.deepcopy(nn.Sequential(*layers[a:b])).to(device)
        meter, last = ActivationMeter(stage), i == len(bounds) - 2

        def forward(stage=stage, x=x, first=i == 0, meter=meter):
            return stage_forward(stage, x, device, first, meter)

        def both(forward=forward, last=last):
            inp, out = forward()
            stage_backward(inp, out.float().mean() if last else out, None if last else torch.ones_like(out))

        f = median_time(forward, reps, sync, PIECE_BUDGET_S)
        fwd.append(f)
        bwd.append(max(median_time(both, reps, sync, PIECE_BUDGET_S) - f, 0.0))
        x = forward()[1].detach()
    return fwd, bwd


def stage_forward(stage: nn.Module, x: torch.Tensor, device: torch.device, first: bool, meter: ActivationMeter):
    """Run one stage on its device. The input is copied there (the transfer between devices; a real
    copy on virtual devices too) and cut from the previous stage's graph, so that each stage's backward
    runs on its own (thread). Returns (input, output). Counted as moved, past the first stage."""
    if not first:
        wire.moved([x])
    inp = x.to(device, copy=True).detach().requires_grad_(not first)
    with meter:
        return inp, stage(inp)


def stage_backward(inp: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor | None) -> torch.Tensor | None:
    """Backward through one stage (grad_out None: `out` is the weighted loss); returns the gradient for
    the previous stage's output. The incoming gradient is copied to this stage's device: the transfer
    back, mirroring stage_forward's."""
    if grad_out is not None:
        wire.moved([grad_out])
    out.backward(None if grad_out is None else grad_out.to(out.device, copy=True))
    return inp.grad
