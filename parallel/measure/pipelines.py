"""The pipelines family: model_parallel and pipeline (a process's stages, a thread each: `Threads`),
pipeline_dist and fsdp_pp (torch.distributed.pipelining, a process a stage or two: `Torch`). What each
stage held, its idle time beside the schedule's theory (every rank's actions replayed on the run's own
pieces, replay.py, and the closed form), the cost model's step (the schedule played out on calibrated
stage times, stage_time.simulate), and the report's table, notes and pictures (the schedule's chart:
stage_time.gantt). The strategies lend their state; docs/pipelines.md."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import ClassVar

from parallel import measure
from parallel.kit.collectives import every_rank
from parallel.kit.schedules import SCHEDULES
from parallel.kit.stages import describe
from parallel.loop.results import Measured
from parallel.measure.replay import closed_form_idle, hop_ms, pipeline_theory, torch_groups, torch_orders
from parallel.measure.stage_time import gantt, simulate
from parallel.style import charts, tables

FAMILY = "pipelines"


@dataclass
class Result:
    """What the report reads of a pipeline's row (its details["pipelines"]); per stage, in stage order."""

    FAMILY: ClassVar[str] = FAMILY
    balance: str  # how the stages were cut: by measured "time" or by "params"
    stages: str  # the cut, as layer ranges: "0-1 | 2-11"
    bounds: list[int]  # stage i = layers[bounds[i]:bounds[i+1]]
    schedule: str | None = None  # None: one stage at a time (model_parallel)
    m: int = 1  # micro-batches per step
    v: int = 1  # stages per rank
    lanes: str = "stage"  # a row of the schedule's chart: a "stage" (threads) or a "rank" (processes)
    mesh: str | None = None  # pp x dp (fsdp_pp)
    param_bytes: list[int] | None = None  # each stage's parameters (threads)
    activation_bytes: list[int] | None = None  # what each saved for backward in a step (threads)
    peak_activation_bytes: list[int] | None = None  # the most each held at once
    held_measured: list[int] | None = None  # the most micro-batches each held at once: peak over one's
    held_predicted: list[int] | None = None  # ... by its schedule's order alone (replay.held)
    busy_ms: list[float] | None = None  # median ms each stage (each rank: its stages) computed a step
    rank_idle_fraction: list[float] | None = None  # each rank's median idle fraction of a step (processes)
    timeline: list | None = None  # the last step's (start ms, end ms, label), per stage or rank
    replay_timeline: list | None = None  # every rank's actions replayed: the same, per rank
    replayed_step_ms: float | None = None  # the replay's step: its end plus the step's time outside it
    replayed_rank_idle: list[float] | None = None
    piece_ms: dict | None = None  # the median ms of each stage's F, I, B, W: "0F"
    hop_ms: dict | None = None  # each boundary's hand-off, measured after the run: "0" (stages 0 | 1)


def result(row) -> Result | None:
    return measure.result_of(row, Result)


def _theory(result: Result, theory: dict) -> None:
    for k, v in theory.items():  # pipeline_theory's keys are Result's fields
        setattr(result, k, v)


class Threads(measure.Family):
    """model_parallel (`one_at_a_time`) and pipeline, lending t.state's `split` (kit.stages.Split) and
    `watch` (stage_time.Watch), and where micro-batches flow, `ops` (each stage's ("F" | "B", micro-batch)
    in order), `m` and `schedule` (its name): what the stages held, and their idle time beside the theory
    of the schedule (one stage at a time is gpipe of one micro-batch; hand-offs are inside the pieces)."""


    def __init__(self, one_at_a_time: bool = False):
        self.one_at_a_time = one_at_a_time

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        s, sp, w = t.state, t.state.split, t.state.watch
        p, schedule, m = len(sp.stages), getattr(s, "schedule", None), getattr(s, "m", 1)
        acts = [meter.bytes // w.metered() for meter in w.meters]  # held at the end of forward
        r = Result(sp.balance, sp.describe(), sp.bounds, schedule, m, param_bytes=sp.param_bytes(),
                   activation_bytes=acts)
        if schedule is not None:
            one = [b / m for b in acts]  # a step's, over its micro-batches (alike when m | batch)
            r.peak_activation_bytes = w.peak
            r.held_measured = [round(pk / o) if o else 0 for pk, o in zip(w.peak, one, strict=True)]
        ops = getattr(s, "ops", None) or [[("F", 0), ("B", 0)]] * p
        return {FAMILY: r, "measured": self._idle(r, w.busy, run.warmup, ops, schedule or "gpipe", result.step_s)}

    @staticmethod
    def _idle(r: Result, busy, skip: int, ops, schedule: str, step_s: list[float]) -> Measured:
        """The measured idle fraction and each stage's busy ms (medians after `skip` steps) into `r`, beside
        the theory: `ops` replayed on the pieces' median times (pipeline_theory) and the closed form.
        `step_s`: the timed steps' seconds, for the time a step spends outside the pieces."""
        p, m = len(ops), 1 + max(j for stage in ops for _, j in stage)
        pieces = busy.piece_ms(skip)
        closed = closed_form_idle(schedule, p, m, 1, pieces) if busy.pieces else (p - 1) / (m + p - 1)
        if not busy.bubbles:
            return Measured(bubble_theory=closed)
        orders = {s: [(s, kind, j) for kind, j in stage] for s, stage in enumerate(ops)}
        theory = pipeline_theory(orders, pieces, {}, busy.outside_ms(step_s), rank=None)
        per_stage = list(zip(*(busy.busy_ms[skip:] or busy.busy_ms), strict=True))
        r.busy_ms, r.timeline = [round(statistics.median(s), 2) for s in per_stage], busy.timeline
        replayed = theory.pop("replayed_idle", None)
        _theory(r, theory)
        return Measured(bubble_measured=statistics.median(busy.bubbles[skip:] or busy.bubbles), bubble_theory=closed,
                        bubble_replayed=replayed)

    def predict_step_ms(self, cal, run, row) -> float | None:
        """One stage at a time: the whole model's compute, plus the activations and gradients copied; a
        pipeline: its schedule played out (schedule_ms)."""
        if self.one_at_a_time:
            return cal.compute_ms(run.batch_size) + cal.copy_ms(row.comm_bytes_per_step or 0)
        return schedule_ms(cal, row, run.batch_size)


def schedule_ms(cal, row, batch: int) -> float | None:
    """A gpipe or 1f1b step of the row's stages over its m micro-batches of `batch`, played out on each
    stage's own forward and backward times calibrated at the micro-batch size (stage_time.simulate), plus
    the transfers between stages."""
    r = result(row)
    if r is None or r.schedule not in SCHEDULES:
        return None
    p, m = len(r.bounds) - 1, r.m
    fwd, bwd = cal.stage_ms(r.bounds, -(-batch // m))
    hop = cal.copy_ms((row.comm_bytes_per_step or 0) / (2 * m * (p - 1))) if p > 1 else 0.0  # one activation
    return simulate([SCHEDULES[r.schedule](s, p, m) for s in range(p)], fwd, bwd, hop)


class Torch(measure.Family):
    """pipeline_dist and fsdp_pp, reading `run.options` (schedule, microbatches, balance, v: stages per
    rank, placement: "loop" | "v"), `dims(run, dist)` where the pipelines are data-parallel too
    (fsdp_pp's pp x dp), and t.state's `busy` (stage_time.Busy), `stages` (stage_time.timed_stage's),
    `bounds`, `p`, `rank` and `schedule` (torch's)."""


    def __init__(self, dims=None):
        self.dims = dims

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        """The bubble: per step, each rank idle for the part of the step's span (start to the last piece of
        work on any rank, one host's clock) it was not computing; point-to-point bytes; activations held;
        and the theory (pipeline_theory): every rank's actions replayed on the pieces' median times
        measured here and the hand-offs measured after the run (fsdp_pp's pipelines: hand-offs left out)."""
        s, o, skip = t.state, run.options, run.warmup
        by_stage = {key: {st.stage_index: getattr(st, attr) for st in s.stages}
                    for key, attr in (("peak", "peak"), ("one", "one"), ("out", "out_bytes"))}
        mine = {"busy": [b[0] for b in s.busy.busy_ms[skip:]], "end": s.busy.ends_ms[skip:], **by_stage,
                "pieces": s.busy.piece_ms(skip),
                "timeline": s.busy.timeline[0] if s.busy.timeline else []}
        ranks = every_rank(mine)
        peaks, ones, outs, pieces = ({k: v for r in ranks for k, v in r[key].items()}
                                     for key in ("peak", "one", "out", "pieces"))
        r = Result(o.balance, describe(s.bounds), s.bounds, o.schedule, o.microbatches, o.v, "rank",
                   str(self.dims(run, dist)) if self.dims else None,
                   peak_activation_bytes=[peaks[i] for i in sorted(peaks)],
                   held_measured=[round(peaks[i] / ones[i]) if ones[i] else 0 for i in sorted(peaks)])
        hop = hop_ms(outs, s.p, o.placement, dist) if s.p == dist.world_size else {}
        closed = closed_form_idle(o.schedule, s.p, o.microbatches, o.v, pieces)
        out = {FAMILY: r, **result.wire.measurements(), "measured": Measured(bubble_theory=closed)}
        if not (mine["end"] and result.step_s):
            return out
        bubbles, per_rank = [], [[] for _ in ranks]
        for step in range(len(mine["end"])):
            span = max(q["end"][step] for q in ranks)
            idle = [1 - q["busy"][step] / span for q in ranks]
            bubbles.append(statistics.fmean(idle))
            for i, f in enumerate(idle):
                per_rank[i].append(f)
        theory = pipeline_theory(torch_orders(s.schedule, o.schedule, s.p, o.microbatches), pieces, hop,
                                 s.busy.outside_ms(result.step_s), rank=s.rank,  # this rank's: its step times
                                 late=o.v == 1,  # gpipe, 1f1b: each receive posted right before its use
                                 groups=torch_groups(s.schedule, o.schedule, s.p))
        r.rank_idle_fraction = [round(statistics.median(q), 3) for q in per_rank]
        r.busy_ms = [round(statistics.median(q["busy"]), 2) for q in ranks]  # per rank: its stages
        r.timeline = [q["timeline"] for q in ranks]  # the last step, per rank (report.html)
        out["measured"] = Measured(bubble_measured=statistics.median(bubbles), bubble_theory=closed,
                                   bubble_replayed=theory.pop("replayed_idle", None))
        _theory(r, theory)
        return out

    def predict_step_ms(self, cal, run, row) -> float | None:
        """gpipe and 1f1b: the schedule played out on each stage's calibrated forward and backward times (as
        `pipeline`'s); the looped and zero-bubble schedules, and FSDP2's collectives within a stage
        (fsdp_pp), are not modelled (None)."""
        r = result(row)
        return schedule_ms(cal, row, run.batch_size) if r and r.v == 1 and not self.dims else None


# The report ---------------------------------------------------------------------------------------------


def rows(all_rows: list) -> list:
    """The pipeline rows: those whose idle time has a theory beside it."""
    return [r for r in all_rows if r.status == "ok" and result(r) is not None and
            (r.measured.bubble_theory is not None or r.measured.bubble_replayed is not None)]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _beside(measured: str, theory: str) -> str:
    return measured if theory in ("", "-") else f"{measured} ({theory})"


def _numbers(values) -> str:
    return " ".join(map(str, values or [])) or "-"


def table(all_rows: list, wide: bool = False):
    """Every pipeline row: its schedule and micro-batches, the idle fraction and step measured beside
    every rank's actions replayed on the run's own piece times (in brackets), the schedule's closed form,
    and the micro-batches each stage held at once beside what its order holds (wide: the cut, the
    activation bytes, the cost model's step, what goes point to point, the model state per rank)."""
    chosen = rows(all_rows)
    if not chosen:
        return None
    heads = [("strategy", "left"), ("schedule", "left"), ("m", "right"), ("idle (replay)", "right"),
             ("closed", "right"), ("ms (replay)", "right"), ("held (order)", "right")]
    if wide:
        heads += [("stages (layers)", "left"), ("activations", "right"), ("ms (model)", "right"),
                  ("sent/step", "right"), ("model state per rank", "right")]
    t = tables.table("Pipelines: idle and step against the schedule replayed on its own pieces; micro-batches held",
                     heads)
    t.columns[0].min_width = 16
    for r in chosen:
        p, m, replayed = result(r), r.measured, result(r).replayed_step_ms
        label = " ".join(w for w in r.label.split(" ") if not w.startswith("schedule="))  # its own column
        cells = [label, p.schedule or "-", str(p.m), _beside(_pct(m.bubble_measured), _pct(m.bubble_replayed)),
                 _pct(m.bubble_theory), _beside(tables.num(r.step_ms_p50, ".1f"),
                                                tables.num(replayed, ".1f") if replayed else "-"),
                 _beside(_numbers(p.held_measured), _numbers(p.held_predicted))]
        if wide:
            acts = p.peak_activation_bytes or p.activation_bytes or []
            cells += [p.stages, " / ".join(tables.size(b, short=True) for b in acts),
                      tables.num(r.step_ms_predicted, ".1f"), tables.size(r.comm_bytes_per_step),
                      " / ".join(tables.size(b, short=True) for b in r.details.get("model_state_bytes_per_device")
                                 or [])]
        t.add_row(*cells)
    return t


def gaps(all_rows: list) -> list[str]:
    """Why a pipeline row idled more than its schedule replayed on its own pieces (by over a quarter of
    it), or, where it was not replayed, than its closed form (which assumes equal stages)."""
    out = []
    for r in all_rows:
        p = result(r)
        m, busy = r.measured, p and p.busy_ms
        if m.bubble_measured is None or not busy or len(busy) < 2:
            continue
        replayed = m.bubble_replayed is not None
        theory = (m.bubble_replayed if replayed else m.bubble_theory) or 0.0
        if m.bubble_measured <= theory * 1.25 or m.bubble_measured - theory <= 0.02:
            continue
        each = " / ".join(f"{b:.1f}" for b in busy)
        why = ("the replay has every piece's own time and the hand-offs, so the rest is the time between pieces: "
               "the schedule's own work (posting and waiting on sends and receives), which it does not price"
               if replayed else
               f"its stages were busy {each} ms a step, and a faster stage waits for a slower one, which the closed "
               "form's equal stages leave out" if max(busy) > 1.1 * min(busy) else
               f"its stages were equally busy ({each} ms), so the rest is what each of the m hand-offs costs "
               "(copies, queues, send/recv), which the closed form leaves out")
        out.append(f"{r.label}: idle {m.bubble_measured:.0%} of each step against {theory:.0%} "
                   f"{'replayed' if replayed else 'in theory'}: {why}.")
    return out


def stage_memory(all_rows: list) -> str | None:
    """Each pipeline stage's model state and the activations it held at once (its own scale: activations
    dwarf a small model's state)."""
    bars = []
    for r in rows(all_rows):
        p = result(r)
        state = r.details.get("model_state_bytes_per_device") or []
        acts = p.peak_activation_bytes or p.activation_bytes or []
        for k in range(max(len(state), len(acts))):
            bars.append((f"{r.label} stage {k}", {"model state": state[k] if k < len(state) else None,
                                                  "activations": acts[k] if k < len(acts) else None}, None))
    return charts.stacked(bars)


def pictures(all_rows: list) -> list[tuple[str, str | None, str]]:
    """report.html's sections, (title, svg, caption): each pipeline's schedule as it ran and as replayed."""
    return [(f"Pipeline schedule: {r.label}", gantt(p.timeline, p.replay_timeline, p.lanes),
             f"{p.schedule or 'one stage at a time'}, m = {p.m}, stages {p.stages}: idle "
             f"{_pct(r.measured.bubble_measured)} measured, {_pct(r.measured.bubble_replayed)} replayed")
            for r in rows(all_rows) for p in [result(r)]]
