"""What model parallelism and its pipelined form share: cutting a model into K contiguous stages, one
per device, balanced by measured time (or by parameter count), and counting what each stage holds.

    layers:   [conv1 relu pool conv2 relu pool flatten | fc1 relu fc2 relu fc3]
    stages:    stage 0 on device 0                     | stage 1 on device 1
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.profiler import record_function

from parallel.devices import IntervalClock, synchronizer_all
from parallel.errors import ConfigError
from parallel.results import Measured
from parallel.strategies.base import local, param_bytes
from parallel.timing import median_time


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
        costs.append(median_time(functools.partial(_fwd_bwd, here, a), reps, sync))  # synchronized clocks
        x = here(a).detach()
        moves.append(hop(x) if hop is not None else
                     median_time(functools.partial(_copy_there_and_back, x, other, home), reps, sync))
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

    def describe(self) -> str:
        return describe(self.bounds)

    def param_bytes(self) -> list[int]:
        return [param_bytes(s.parameters()) for s in self.stages]


def describe(bounds: list[int]) -> str:
    """Stage bounds as the report shows them: [0, 3, 12] -> "0-2 | 3-11" (layer indices)."""
    return " | ".join(f"{a}-{b - 1}" for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def given_cut(config, balance: str, k: int, layers: list[nn.Module]) -> list[int] | None:
    """The cut into k stages an earlier row of this run decided (RunConfig.cuts), if it fits these layers."""
    bounds = config.cuts.get(f"{balance}:{k}")
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


def split(model: nn.Module, devices: list[torch.device], balance: str, sample: torch.Tensor,
          bounds: list[int] | None = None) -> Split:
    """Cut `model` into len(devices) stages (at `bounds` where given) and move each to its device
    (parameters stay the model's own, so model.state_dict() still names and holds them)."""
    layers = layers_of(model)
    bounds = bounds or cut(layers, len(devices), balance, sample, devices)
    stages = [nn.Sequential(*layers[a:b]).to(d) for a, b, d in zip(bounds[:-1], bounds[1:], devices, strict=True)]
    return Split(stages, devices, bounds, balance)


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

        f = median_time(forward, reps, sync)
        fwd.append(f)
        bwd.append(max(median_time(both, reps, sync) - f, 0.0))
        x = forward()[1].detach()
    return fwd, bwd


def simulate(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> float:
    """How long a schedule takes (`play`'s last end). Unequal stages and unequal forward and backward
    times are what the (p-1)/(m+p-1) formula leaves out (GPipe's forward phase runs at the slowest
    forward, its backward phase at the slowest backward)."""
    return max(end for _, _, end, _, _ in play(ops, fwd, bwd, hop))


def play(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> list[tuple]:
    """A schedule played out: stage s runs ops[s] ("F" | "B", micro-batch) in order, each F taking fwd[s]
    and each B bwd[s]; F(s, j) also waits for F(s-1, j) and B(s, j) for B(s+1, j), plus `hop` for the
    transfer between stages. Returns every piece as (stage, start, end, kind, micro-batch)."""
    p, done, free, at, out = len(ops), {}, [0.0] * len(ops), [0] * len(ops), []
    left = sum(map(len, ops))
    while left:
        moved = False
        for s in range(p):
            while at[s] < len(ops[s]):
                kind, j = ops[s][at[s]]
                dep = ((s - 1, "F", j) if kind == "F" and s > 0 else
                       (s + 1, "B", j) if kind == "B" and s < p - 1 else None)
                if dep is not None and dep not in done:
                    break
                start = max(free[s], done[dep] + hop if dep is not None else 0.0)
                free[s] = done[(s, kind, j)] = start + (fwd[s] if kind == "F" else bwd[s])
                out.append((s, start, free[s], kind, j))
                at[s], left, moved = at[s] + 1, left - 1, True
        if not moved:
            raise ValueError("the schedule waits on itself")
    return out


class ActivationMeter:
    """Bytes autograd saves for backward while a stage runs forward (its activation memory), leaving
    out the parameters it also saves; of a DTensor, what this device holds. Use: `with meter: y = stage(x)`.
    Its hook costs a few percent of a stage's step (measured 1-4% on the CNN's pipeline), so the strategies
    switch it off (`active = False`) after the warm-up steps, as wire.Counter does: the bytes saved are
    the same at every step."""

    def __init__(self, stage: nn.Module):
        self.params = {local(p).data_ptr() for p in stage.parameters()}
        self.bytes = 0
        self.active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._entered = False

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = local(t)
        if held.data_ptr() not in self.params:
            self.bytes += held.numel() * held.element_size()
        return t

    def __enter__(self):
        self._entered = self.active
        if self._entered:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._entered:
            self._hooks.__exit__(*exc)


def stage_forward(stage: nn.Module, x: torch.Tensor, device: torch.device, first: bool, meter: ActivationMeter):
    """Run one stage on its device. The input is copied there (the transfer between devices; a real
    copy on virtual devices too) and cut from the previous stage's graph, so that each stage's backward
    runs on its own (thread). Returns (input, output)."""
    inp = x.to(device, copy=True).detach().requires_grad_(not first)
    with meter:
        return inp, stage(inp)


def stage_backward(inp: torch.Tensor, out: torch.Tensor, grad_out: torch.Tensor | None) -> torch.Tensor | None:
    """Backward through one stage (grad_out None: `out` is the weighted loss); returns the gradient for
    the previous stage's output. The incoming gradient is copied to this stage's device: the transfer
    back, mirroring stage_forward's."""
    out.backward(None if grad_out is None else grad_out.to(out.device, copy=True))
    return inp.grad


class Busy:
    """Busy intervals of each stage within a step, on one clock per step: `busy.start_step()`, then
    `with busy(s, label): ...` around each piece of stage s's work, then `busy.end_step()`. The bubble is
    the mean fraction of the step's span during which a stage had nothing to do. The stamps come from an
    IntervalClock: host clock reads on CPU, CUDA events on GPUs (synchronizing around every interval
    would stop the host from queueing ahead and inflate the very bubble measured)."""

    def __init__(self, devices: list[torch.device]):
        self.devices = devices
        self.clock = IntervalClock(devices)
        self.stamps: list[list[tuple]] = [[] for _ in devices]
        self.bubbles: list[float] = []
        self.busy_ms: list[list[float]] = []
        self.ends_ms: list[float] = []  # when the step's last piece of work ended, since the step started
        self._last: list = []  # the last step's intervals and stamps, per stage (`timeline`, after the run)

    def start_step(self) -> None:
        self.clock.start_step()

    @contextlib.contextmanager
    def __call__(self, s: int, label: str):
        with record_function(f"stage {s} {label}"):  # named in profiles
            start = self.clock.stamp([self.devices[s]])
            yield
            self.stamps[s].append((start, self.clock.stamp([self.devices[s]]), label))  # only stage s's thread appends

    def end_step(self) -> None:
        self.clock.end_step()
        intervals = [[(self.clock.seconds(a, first=True), self.clock.seconds(b)) for a, b, _ in stage]
                     for stage in self.stamps]
        self._last = list(zip(intervals, self.stamps, strict=True))  # kept as they are: the step is on the clock
        spans = [iv for stage in intervals for iv in stage]
        span = max(e for _, e in spans) - min(b for b, _ in spans)
        busy = [sum(e - b for b, e in stage) for stage in intervals]
        self.bubbles.append(sum(1 - b / span for b in busy) / len(busy))
        self.busy_ms.append([b * 1e3 for b in busy])
        self.ends_ms.append(max(e for _, e in spans) * 1e3)
        self.stamps = [[] for _ in self.stamps]

    @property
    def timeline(self) -> list[list[tuple]]:
        """The last step's (start ms, end ms, label) per stage, for report.html's schedule chart."""
        return [[(round(b * 1e3, 3), round(e * 1e3, 3), label) for (b, e), (_, _, label) in zip(stage, stamps,
                                                                                                strict=True)]
                for stage, stamps in self._last]

    def summary(self, skip: int, p: int, m: int) -> dict:
        theory = (p - 1) / (m + p - 1)
        if not self.bubbles:
            return {"measured": Measured(bubble_theory=theory)}
        kept = self.bubbles[skip:] or self.bubbles
        per_stage = list(zip(*(self.busy_ms[skip:] or self.busy_ms), strict=True))
        return {"measured": Measured(bubble_measured=statistics.median(kept), bubble_theory=theory),
                "stage_busy_ms": [round(statistics.median(s), 2) for s in per_stage], "stage_timeline": self.timeline}


def timed_stage(module, index, count, device, group, busy: Busy, meter: ActivationMeter):
    """torch's PipelineStage (pipeline_dist, fsdp_pp) with its forward and backward pieces timed on `busy`
    and the activations they keep for backward counted by `meter`: torch's schedules call these three
    methods of a stage. `stage.peak`: the most activation bytes it held at once."""
    from torch.distributed.pipelining import PipelineStage

    class Timed(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            before = meter.bytes
            with busy(0, f"stage {index} F{fwd_chunk_id}"), meter:
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            self.held[fwd_chunk_id] = meter.bytes - before
            self.peak = max(self.peak, sum(self.held.values()))
            return out

        def backward_one_chunk(self, bwd_chunk_id, loss=None, full_backward=True, last_backward=False):
            with busy(0, f"stage {index} {'B' if full_backward else 'I'}{bwd_chunk_id}"):
                out = super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                                 last_backward=last_backward)
            if full_backward:
                self.held.pop(bwd_chunk_id, None)
            return out

        def backward_weight_one_chunk(self, bwd_chunk_id, last_backward=False):
            with busy(0, f"stage {index} W{bwd_chunk_id}"):
                out = super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            self.held.pop(bwd_chunk_id, None)  # the weight gradient was the last to need them
            return out

    stage = Timed(module, index, count, device, group=group)
    stage.held, stage.peak, stage.meter = {}, 0, meter  # micro-batch -> activation bytes kept; the most at once
    return stage
