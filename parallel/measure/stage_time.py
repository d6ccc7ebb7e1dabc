"""Time on a pipeline's stages: a schedule played out on given forward and backward times (`play`,
`simulate`: the theory beside a measurement, and the cost model's prediction), and measured (`Busy`: each
stage's busy intervals in a step; `Watch`: a process's stages watched; `timed_stage`: torch's PipelineStage
with its pieces timed); and drawn (`gantt`, report.html's chart of a step). The stages
themselves, how a model is cut into them and what they hold: stages.py.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import statistics

import torch
from torch.autograd.profiler import record_function

from parallel.kit.saved import ActivationMeter
from parallel.loop import wire
from parallel.measure.replay import replay
from parallel.style import charts
from parallel.world.devices import IntervalClock

PIECE = re.compile(r"(?:stage (\d+) )?([FBIWL])(\d+)$")  # a Busy label: "F3" (stage = its lane), "stage 2 W0"
PIECE_COLOR = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#8172b3", "L": "#55a868"}


def simulate(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> float:
    """How long a schedule takes (`play`'s last end). Unequal stages and unequal forward and backward
    times are what the (p-1)/(m+p-1) formula leaves out (GPipe's forward phase runs at the slowest
    forward, its backward phase at the slowest backward)."""
    return max(end for _, _, end, _, _ in play(ops, fwd, bwd, hop))


def play(ops: list[list[tuple[str, int]]], fwd: list[float], bwd: list[float], hop: float = 0.0) -> list[tuple]:
    """A schedule of one stage per device played out (`replay`): stage s runs ops[s] ("F" | "B",
    micro-batch) in order, each F taking fwd[s] and each B bwd[s], plus `hop` for every hand-off between
    stages. Returns every piece as (stage, start, end, kind, micro-batch)."""
    orders = {s: [(s, kind, j) for kind, j in stage] for s, stage in enumerate(ops)}
    ms = {(s, kind): (fwd if kind == "F" else bwd)[s] for s in range(len(ops)) for kind in "FB"}
    return [(s, b, e, kind, j) for _, s, kind, j, b, e in replay(orders, ms, dict.fromkeys(range(len(ops)), hop))]


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
        self.starts_ms: list[float] = []  # when its first began
        self.pieces: list[dict[tuple[int, str], list[float]]] = []  # per step: (stage, F|I|B|W) -> each one's ms
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
        self.starts_ms.append(min(b for b, _ in spans) * 1e3)
        pieces: dict[tuple[int, str], list[float]] = {}
        for lane, stage in enumerate(self._last):
            for (b, e), (_, _, label) in zip(*stage, strict=True):
                if m := PIECE.search(label):
                    pieces.setdefault((int(m.group(1) or lane), m.group(2)), []).append((e - b) * 1e3)
        self.pieces.append(pieces)
        self.stamps = [[] for _ in self.stamps]

    def outside_ms(self, step_s: list[float]) -> float:
        """The median time a timed step (`step_s`: the timed steps' seconds, the last of the steps seen here)
        spent outside the span of its pieces: before the first (zero_grad, cutting the batch into
        micro-batches) and after the last (the optimiser step)."""
        if not step_s:
            return 0.0
        spans = [e - b for b, e in zip(self.starts_ms[-len(step_s):], self.ends_ms[-len(step_s):], strict=True)]
        return statistics.median(1e3 * t - span for t, span in zip(step_s, spans, strict=True))

    def piece_ms(self, skip: int) -> dict[tuple[int, str], float]:
        """The median ms of each stage's F, I, B and W over the steps after the first `skip` (the replay's
        durations; a rank's Busy knows its own stages only)."""
        steps = self.pieces[skip:] or self.pieces
        keys = {k for step in steps for k in step}
        out = {k: statistics.median([ms for step in steps for ms in step.get(k, [])]) for k in keys}
        for (s, kind) in [k for k in out if k[1] == "L"]:  # the loss, where the schedule computes it apart: the
            out[(s, "F")] = out.get((s, "F"), 0.0) + out.pop((s, kind))  # last stage's forward includes it
        return out

    @property
    def timeline(self) -> list[list[tuple]]:
        """The last step's (start ms, end ms, label) per stage, for report.html's schedule chart."""
        return [[(round(b * 1e3, 3), round(e * 1e3, 3), label) for (b, e), (_, _, label) in zip(stage, stamps,
                                                                                                strict=True)]
                for stage, stamps in self._last]


class Watch:
    """How the stages of one process (model_parallel, pipeline: a thread each) are watched, for the report
    alone: each piece's busy interval (`Busy`), the activation bytes each stage saves for backward (its
    ActivationMeter, on in the first `meter_steps` steps only: the warm-up, off the clock), and the most
    each stage held at once (`peak`, over the micro-batches it had run forward and not yet backward).
    `with watch.forward(s, j): ...` around stage s's forward of micro-batch j (giving the stage its
    meter, watch.meters[s]), `with watch.backward(s, j): ...` around its backward; stage s's thread only
    touches stage s's entries."""

    def __init__(self, stages: list, devices: list[torch.device], meter_steps: int):
        self.busy, self.meters = Busy(devices), [ActivationMeter(s) for s in stages]
        self.meter_steps, self.seen = max(1, meter_steps), 0  # steps the meters count; steps begun
        self.peak = [0] * len(stages)  # the most activation bytes each stage held at once, over the run
        self.held: list[dict[int, int]] = [{} for _ in stages]  # per stage: micro-batch -> bytes it holds

    def start_step(self) -> None:
        for m in self.meters:
            m.active = self.seen < self.meter_steps
        self.seen += 1
        self.held = [{} for _ in self.held]  # a micro-batch whose backward never ran (an injected bug) is gone
        self.busy.start_step()

    def end_step(self) -> None:
        self.busy.end_step()

    def metered(self) -> int:
        """The steps the meters counted (at least one)."""
        return max(1, min(self.seen, self.meter_steps))

    @contextlib.contextmanager
    def forward(self, s: int, j: int):
        before = self.meters[s].bytes
        with self.busy(s, f"F{j}"):
            yield
        self.held[s][j] = self.meters[s].bytes - before
        self.peak[s] = max(self.peak[s], sum(self.held[s].values()))

    @contextlib.contextmanager
    def backward(self, s: int, j: int):
        with self.busy(s, f"B{j}"):
            yield
        self.held[s].pop(j, None)


def timed_loss(loss_fn, busy: Busy, stage: int, m: int):
    """`loss_fn` with its time on `busy` as stage `stage`'s "L" piece, micro-batch by micro-batch (m a
    step): torch's schedules compute the loss outside the last stage's forward_one_chunk (the
    transformer's logits make it a tenth of a step)."""
    count = itertools.count()

    def loss(*args, **kwargs):
        with busy(0, f"stage {stage} L{next(count) % m}"):
            return loss_fn(*args, **kwargs)

    return loss


def timed_stage(module, index, count, device, group, busy: Busy, meter: ActivationMeter):
    """torch's PipelineStage (pipeline_dist, fsdp_pp) with its forward and backward pieces timed on `busy`
    and the activations they keep for backward counted by `meter`: torch's schedules call these three
    methods of a stage. `stage.peak`: the most activation bytes it held at once; `stage.one`: one micro-batch's
    (while the meter is on: the warm-up steps)."""
    from torch.distributed.pipelining import PipelineStage

    class Timed(PipelineStage):
        def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
            meter.active = wire.counting()  # the warm-up steps (off the clock), as the collectives are counted
            before = meter.bytes
            with busy(0, f"stage {index} F{fwd_chunk_id}"), meter:
                out = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            self.held[fwd_chunk_id] = meter.bytes - before
            self.peak, self.one = max(self.peak, sum(self.held.values())), max(self.one, self.held[fwd_chunk_id])
            self.out_bytes = sum(t.numel() * t.element_size() for t in (out if isinstance(out, tuple) else (out,))
                                 if isinstance(t, torch.Tensor))
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
    # micro-batch -> activation bytes kept; the most at once; one micro-batch's; the bytes its output sends on
    stage.held, stage.peak, stage.one, stage.out_bytes, stage.meter = {}, 0, 0, 0, meter
    return stage


def pieces(timeline: list) -> list[tuple[int, float, float, str, int]]:
    """(row of the chart, start ms, end ms, kind, micro-batch) from a Busy timeline or a replay's: a process's
    stages give one list per stage; pipeline_dist one list per rank, whose labels name the stage."""
    out = []
    for lane, intervals in enumerate(timeline):
        for start, end, label in intervals:
            if m := PIECE.search(str(label)):
                out.append((lane, float(start), float(end), m.group(2), int(m.group(3))))
    return out


def gantt(timeline: list | None, replayed: list | None, lanes: str = "stage") -> str | None:
    """A step as each stage (or rank: `lanes`) spent it, beside every rank's actions replayed on the
    medians of those same pieces and the measured hand-offs (replay.pipeline_theory): the gap between
    the two is what the replay leaves out (the time between pieces: the schedule's own work, waiting)."""
    measured = pieces(timeline or [])
    if not measured:
        return None
    n = max(p[0] for p in measured) + 1
    theory = pieces(replayed or [])
    panels = [("measured: the last step", measured)] + ([("replayed: every rank's actions on the median pieces",
                                                           theory)] if theory else [])
    fig, axes = charts.plt().subplots(len(panels), 1, figsize=(7.5, 0.8 + 0.45 * n * len(panels) + 0.4 * len(panels)),
                                      sharex=True, squeeze=False)
    for ax, (title, ps) in zip(axes[:, 0], panels, strict=True):
        t0 = min(b for _, b, _, _, _ in ps)
        for lane, b, e, kind, j in ps:
            ax.barh(lane, e - b, left=b - t0, color=PIECE_COLOR[kind], edgecolor="white", linewidth=0.5)
            if e - b > 0:
                ax.text(b - t0 + (e - b) / 2, lane, f"{kind}{j}", ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(n), [f"{lanes} {k}" for k in range(n)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step's first piece of work (F forward, L loss, B backward, I input gradient, "
                           "W weight gradient)")
    return charts.svg(fig)
