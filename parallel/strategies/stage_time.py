"""Time on a pipeline's stages: a schedule played out on given forward and backward times (`play`,
`simulate`: the theory beside a measurement, and the cost model's prediction), and measured (`Busy`: each
stage's busy intervals in a step; `timed_stage`: torch's PipelineStage with its pieces timed). The stages
themselves, how a model is cut into them and what they hold: stages.py.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import statistics
from collections import Counter

import torch
from torch.autograd.profiler import record_function

from parallel.devices import IntervalClock
from parallel.results import Measured
from parallel.strategies.stages import ActivationMeter

Action = tuple[int, str, int]  # (stage, "F" | "I" | "B" | "W", micro-batch): one piece of a schedule
PIECE = re.compile(r"(?:stage (\d+) )?([FBIWL])(\d+)$")  # a Busy label: "F3" (stage = its lane), "stage 2 W0"


def needs(action: Action, stages: int) -> list[tuple]:
    """What must have ended before `action` starts, besides the previous action of its rank: a forward
    needs the previous stage's forward of its micro-batch; a backward (input part I, or whole B) its own
    forward and the next stage's input gradient; a weight gradient W its own I. Keys: (stage, "F" | "G"
    (input gradient made) | "W", micro-batch)."""
    s, kind, j = action
    if kind == "F":
        return [(s - 1, "F", j)] if s else []
    if kind == "W":
        return [(s, "G", j)]
    return [(s, "F", j)] + ([(s + 1, "G", j)] if s < stages - 1 else [])


def _makes(action: Action) -> list[tuple]:
    s, kind, j = action
    return [(s, "F", j)] if kind == "F" else [(s, "G", j)] if kind == "I" else \
        [(s, "W", j)] if kind == "W" else [(s, "G", j), (s, "W", j)]


def replay(orders: dict[int, list[Action]], ms: dict[tuple[int, str], float], hop: dict[int, float] | None = None,
           needs=needs) -> list[tuple]:
    """Every rank's action list played out on piece times: rank r runs orders[r] in order, each action
    (s, kind, j) taking ms[(s, kind)] and starting once its rank is free and what it `needs` has ended,
    plus hop[b] where that crosses boundary b (between stages b and b+1; a boundary within one rank is
    left out of `hop`: free). Returns every piece as (rank, stage, kind, micro-batch, start, end)."""
    hop = hop or {}
    stages = 1 + max(s for acts in orders.values() for s, _, _ in acts)
    done, free, at, out = {}, dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0), []
    left = sum(map(len, orders.values()))
    while left:
        moved = False
        for r, acts in orders.items():
            while at[r] < len(acts):
                action = acts[at[r]]
                deps = needs(action, stages)
                if any(d not in done for d in deps):
                    break
                s, kind, j = action
                start = max([free[r]] + [done[d] + (hop.get(min(d[0], s), 0.0) if d[0] != s else 0.0) for d in deps])
                free[r] = end = start + ms[(s, kind)]
                done.update(dict.fromkeys(_makes(action), end))
                out.append((r, s, kind, j, start, end))
                at[r], left, moved = at[r] + 1, left - 1, True
        if not moved:
            raise ValueError("the schedule waits on itself: " + ", ".join(
                f"rank {r} at {acts[at[r]]}" for r, acts in orders.items() if at[r] < len(acts)))
    return out


def replayed(orders: dict[int, list[Action]], ms: dict[tuple[int, str], float],
             hop: dict[int, float] | None = None) -> dict:
    """`replay`'s verdict: the schedule's span (ms, from the first piece to the last on any rank) and
    each rank's idle fraction of it (1 - its pieces' time over the span)."""
    pieces = replay(orders, ms, hop)
    span = max(p[5] for p in pieces)
    idle = [1 - sum(e - b for q, *_, b, e in pieces if q == r) / span for r in orders]
    return {"span_ms": span, "idle": statistics.fmean(idle), "rank_idle": idle, "pieces": pieces}


def held(orders: dict[int, list[Action]], by: str = "stage") -> dict[int, int]:
    """The most micro-batches whose activations each stage (or rank, `by`) keeps at once, by its rank's
    order alone: from a forward until that micro-batch's last backward piece (B, or W where split)."""
    now, most = Counter(), Counter()
    for r, acts in orders.items():
        for s, kind, _ in acts:
            key = s if by == "stage" else r
            now[key] += 1 if kind == "F" else -1 if kind in "BW" else 0
            most[key] = max(most[key], now[key])
    return dict(most)


# The authors' bubble of a schedule on balanced stages (per rank, in one stage's F, B = I + W, I and W;
# torch runs DualPipeV's overlapped F&B as F then B, so F&B = F + B). A rank's work is m v (F + B).
CLOSED_FORMS = {
    "gpipe": lambda p, f, b, i, w: (p - 1) * (f + b),  # GPipe, 1F1B: (p-1)(F+B) (Huang et al.; Narayanan et al.)
    "1f1b": lambda p, f, b, i, w: (p - 1) * (f + b),
    "interleaved1f1b": lambda p, f, b, i, w: (p - 1) * (f + b),  # a stage's F+B: 1/v of a rank's (Narayanan 2021)
    "loopedbfs": lambda p, f, b, i, w: (p - 1) * (f + b),
    "interleavedzb": lambda p, f, b, i, w: (p - 1) * (f + i - w),  # torch: ZB1P, i.e. ZB-H1 (Qi et al. 2024)
    "dualpipev": lambda p, f, b, i, w: (p - 1) * ((f + b) + b - 3 * w),  # (PP/2-1)(F&B+B-3W), PP = 2p stages
}


def closed_form_idle(schedule: str, p: int, m: int, v: int, ms: dict[tuple[int, str], float]) -> float | None:
    """The idle fraction a schedule's closed form gives on the mean measured piece of a stage: bubble /
    (bubble + m v (F + B)). None where no closed form applies (zbv's authors give none beyond "zero when F
    = I = W")."""
    if schedule not in CLOSED_FORMS or not ms:
        return None
    stages = sorted({s for s, _ in ms})

    def mean(kind: str) -> float:
        return statistics.fmean(ms.get((s, kind), 0.0) for s in stages)

    f, i, w = mean("F"), mean("I"), mean("W")
    b = i + w if i else mean("B")
    i, w = (i, w) if i else (b, 0.0)
    bubble = max(CLOSED_FORMS[schedule](p, f, b, i, w), 0.0)
    return bubble / (bubble + m * v * (f + b))


def pipeline_theory(schedule: str, orders: dict[int, list[Action]], ms: dict[tuple[int, str], float],
                    hop: dict[int, float], m: int, v: int, outside_ms: float, rank: int | None = 0) -> dict:
    """The theory beside a pipeline's measurements (details): every rank's actions replayed on the run's
    own median piece times and hand-offs (`replayed`), its idle fraction and step (rank `rank`'s replayed
    end plus `outside_ms`, the time its measured step spent outside the schedule: zero_grad, the optimiser
    step), the closed form where one applies, the micro-batches each stage holds at once by the order
    (`held`), and the replay's pieces for report.html."""
    r = replayed(orders, ms, hop)
    end = max(e for q, *_, e in r["pieces"] if rank is None or q == rank)  # None: every rank (one process)
    return {"replayed_idle": round(r["idle"], 4), "replayed_step_ms": round(end + outside_ms, 3),
            "replayed_rank_idle": [round(f, 3) for f in r["rank_idle"]],
            "closed_form_idle": closed_form_idle(schedule, len(orders), m, v, ms),
            "held_predicted": [n for _, n in sorted(held(orders).items())],
            "piece_ms": {f"{s}{k}": round(t, 3) for (s, k), t in sorted(ms.items())},
            "hop_ms": {str(b): round(t, 3) for b, t in sorted(hop.items())},
            "replay_timeline": [[(round(b, 3), round(e, 3), f"stage {s} {k}{j}") for q, s, k, j, b, e in r["pieces"]
                                 if q == lane] for lane in orders]}


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

    def summary(self, skip: int, ops: list[list[tuple[str, int]]], schedule: str, step_s: list[float]) -> dict:
        """The measured idle fraction and each stage's busy ms (medians after `skip` steps), beside the
        theory: `ops` (stage s runs ops[s], ("F" | "B", micro-batch), in order, one stage per lane) replayed
        on the pieces' median times (pipeline_theory; hand-offs are inside the pieces here). `step_s`: the
        timed steps' seconds (the warm-up's are not timed), for the time a step spends outside the pieces."""
        p, m = len(ops), 1 + max(j for stage in ops for _, j in stage)
        orders = {s: [(s, kind, j) for kind, j in stage] for s, stage in enumerate(ops)}
        theory = closed_form_idle(schedule, p, m, 1, self.piece_ms(skip)) if self.pieces else (p - 1) / (m + p - 1)
        if not self.bubbles:
            return {"measured": Measured(bubble_theory=theory)}
        kept = self.bubbles[skip:] or self.bubbles
        per_stage = list(zip(*(self.busy_ms[skip:] or self.busy_ms), strict=True))
        outside = self.outside_ms(step_s)
        out = pipeline_theory(schedule, orders, self.piece_ms(skip), {}, m, 1, outside, rank=None)
        return {"measured": Measured(bubble_measured=statistics.median(kept), bubble_theory=theory,
                                     bubble_replayed=out.pop("replayed_idle")),
                "stage_busy_ms": [round(statistics.median(s), 2) for s in per_stage], "stage_timeline": self.timeline,
                **out}


def timed_loss(loss_fn, busy: Busy, stage: int):
    """`loss_fn` with its time on `busy` as stage `stage`'s "L" piece: torch's schedules compute the loss
    outside the last stage's forward_one_chunk (the transformer's logits make it a tenth of a step)."""
    count = itertools.count()

    def loss(*args, **kwargs):
        with busy(0, f"stage {stage} L{next(count)}"):
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
