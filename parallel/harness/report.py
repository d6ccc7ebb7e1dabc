"""The report: one screen on the terminal (100 columns; `--wide` for every column and note), every row's
details in OUT/details.txt, the pictures in OUT/report.html (harness/pictures.py), beside results.json/.csv.

Every table here keeps to 100 columns: `columns(wide)` picks what fits, the rest goes behind `--wide`
and into the files. Cells wrap rather than being cut (`overflow="fold"`), so no number is ever shown
half; tests/test_report.py renders at 80, 100 and 120 columns and looks for a cut."""

from __future__ import annotations

import dataclasses
import os
import re

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from parallel.harness import memcheck, twin
from parallel.measure import sharded
from parallel.results import Row
from parallel.tables import num as _num
from parallel.tables import size as _bytes
from parallel.tables import table as _table

WIDTH = 100  # the report's width when the output is not a terminal (a pipe, a file, CI's log)
VERDICT_STYLE = {"match": "green", "baseline": "cyan", "mismatch": "bold red", "not-expected": "yellow",
                 "unchecked": "dim"}


# The run ------------------------------------------------------------------------------------------------


def run_facts(config) -> dict:
    """What was trained, for the header and results.json: the workload (the user's model by its label),
    its parameter count, the batch, steps and warm-up, precision and seed."""
    from parallel.usermodel import shape_model

    label = config.workload + (f" ({config.preset or config.arch or 'gpt'})" if config.shaped else "")
    return {"workload": label, "params": sum(p.numel() for p in shape_model(config).parameters()),
            "global_batch": config.batch_size, "steps": config.steps, "warmup": config.warmup,
            "precision": config.precision, "seed": config.seed, "why": config.why}


def _count(n: int) -> str:
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def header(environment: dict) -> str:
    """The run in one line: workload and size, batch, steps, devices, precision, seed, torch."""
    run, kind = environment.get("run") or {}, environment["device_kind"]
    what = f"{run['workload']} {_count(run['params'])} params" if run else "?"
    steps = f"{run['steps']} steps + {run['warmup']} warm-up" if run else ""
    return " · ".join(x for x in (
        what, f"batch {run.get('global_batch', '?')}", steps,
        f"{environment['devices']} {kind}" + ("" if kind == "virtual" else f", {environment['backend']}"),
        run.get("precision", ""), f"seed {run.get('seed', '?')}", f"torch {environment['torch']}") if x)


# The main table -----------------------------------------------------------------------------------------


def status(r: Row) -> str:
    """ok | noisy | flag (a measurement that cannot be right as it stands) | the failure."""
    if r.status != "ok":
        return {"timed-out": "timeout"}.get(r.status, r.status)
    if any(f.startswith("noisy") for f in r.flags):
        return "noisy"
    return "flag" if any(not f.startswith("real effect") for f in r.flags) else "ok"


def _devices(r: Row, run_kind: str) -> str:
    return str(r.world_size) if r.device_kind == run_kind else f"{r.world_size} {r.device_kind}"


def _speedup(r: Row, spread: bool = True) -> str:
    """The speedup; with --repeat the median of the paired rounds, and (spread) their range."""
    text = _num(r.speedup, ".2f")
    if spread and len(r.round_speedups) > 1:
        text += f" [{min(r.round_speedups):.2f}-{max(r.round_speedups):.2f}]"
    return text


def equivalence_text(r: Row) -> str:
    """The verdict, and the largest difference over its tolerance: "match 0.0025"."""
    eq = r.equivalence
    if eq.ratio is None or eq.verdict == "baseline":
        return eq.verdict
    return f"{eq.verdict} {'<0.001' if 0 < eq.ratio < 0.001 else format(eq.ratio, '.2g')}"  # 12 columns at most


def main_cells(r: Row, run_kind: str, spread: bool = False) -> list[str]:
    """A row of the main table (MAIN's columns), as the terminal and report.html show it."""
    return [r.label, _devices(r, run_kind), _num(r.step_ms_p50, ".1f"), _speedup(r, spread),
            _num(r.efficiency, ".0%"), _bytes(r.peak_mem_bytes), _bytes(r.comm_bytes_per_step), equivalence_text(r),
            status(r)]


MAIN = [("strategy", "left"), ("devices", "left"), ("ms p50", "right"), ("speedup", "right"), ("eff.", "right"),
        ("peak mem", "right"), ("sent/step", "right"), ("equivalence", "left"), ("status", "left")]
WIDE = [("strategy", "left"), ("launch", "left"), ("devices", "left"), ("ms p50 (p95)", "right"),
        ("pred. ms", "right"), ("samples/s", "right"), ("speedup", "right"), ("eff.", "right"), ("peak mem", "right"),
        ("sent/step (pred.)", "right"), ("loss", "right"), ("eval loss", "right"), ("equivalence", "left"),
        ("status", "left")]


def table(rows: list[Row], environment: dict, wide: bool = False, skipped: dict | None = None) -> Table:
    kind = environment["device_kind"]
    t = _table(twin.title(rows, skipped) or "Every strategy against `single`", WIDE if wide else MAIN)
    t.columns[0].min_width = 16  # a strategy's name whole (context_parallel); a long variant label folds
    for r in rows:
        state = Text(status(r), style="" if status(r) == "ok" else "bold red" if r.status != "ok" else "yellow")
        verdict = Text(equivalence_text(r), style=VERDICT_STYLE.get(r.equivalence.verdict, ""))
        if wide:
            p50 = "-" if r.step_ms_p50 is None else f"{r.step_ms_p50:.1f} ({r.step_ms_p95:.1f})"
            t.add_row(r.label, r.launcher, f"{r.world_size} {r.device_kind}", p50, _num(r.step_ms_predicted, ".1f"),
                      _num(r.samples_per_s, ",.0f"), _speedup(r), _num(r.efficiency, ".0%"), _bytes(r.peak_mem_bytes),
                      f"{_bytes(r.comm_bytes_per_step)} ({_bytes(r.comm_bytes_predicted)})",
                      _num(r.final_loss, ".4f"), _num(r.eval_loss, ".4f"), verdict, state)
        else:
            t.add_row(*main_cells(r, kind)[:-2], verdict, state)
    return t


# The sharded and pipeline tables ------------------------------------------------------------------------


def _largest(v):
    """A per-rank list's largest entry (ranks that did not measure give None), or the value itself."""
    if isinstance(v, list):
        v = [x for x in v if x is not None]
        return max(v) if v else None
    return v


def pipeline_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok" and "stages" in r.details and
            (r.measured.bubble_theory is not None or r.measured.bubble_replayed is not None)]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _beside(measured: str, theory: str) -> str:
    return measured if theory in ("", "-") else f"{measured} ({theory})"


def pipeline_table(rows: list[Row], wide: bool = False) -> Table | None:
    """Every pipeline row: its schedule and micro-batches, the idle fraction and step measured beside
    every rank's actions replayed on the run's own piece times (in brackets), the schedule's closed form,
    and the micro-batches each stage held at once beside what its order holds (wide: the cut, the
    activation bytes, the cost model's step, what goes point to point, the model state per rank)."""
    chosen = pipeline_rows(rows)
    if not chosen:
        return None
    heads = [("strategy", "left"), ("schedule", "left"), ("m", "right"), ("idle (replay)", "right"),
             ("closed", "right"), ("ms (replay)", "right"), ("held (order)", "right")]
    if wide:
        heads += [("stages (layers)", "left"), ("activations", "right"), ("ms (model)", "right"),
                  ("sent/step", "right"), ("model state per rank", "right")]
    t = _table("Pipelines: idle and step against the schedule replayed on its own pieces; micro-batches held", heads)
    t.columns[0].min_width = 16
    for r in chosen:
        d, m = r.details, r.measured
        replayed = d.get("replayed_step_ms")
        label = " ".join(w for w in r.label.split(" ") if not w.startswith("schedule="))  # its own column
        cells = [label, d.get("schedule", "-"), str(d.get("microbatches", 1)),
                 _beside(_pct(m.bubble_measured), _pct(m.bubble_replayed)), _pct(m.bubble_theory),
                 _beside(_num(r.step_ms_p50, ".1f"), _num(replayed, ".1f") if replayed else "-"),
                 _beside(" ".join(map(str, d.get("held_measured") or [])) or "-",
                         " ".join(map(str, d.get("held_predicted") or [])) or "-")]
        if wide:
            acts = d.get("stage_peak_activation_bytes") or d.get("stage_activation_bytes") or []
            cells += [d["stages"], " / ".join(_bytes(b, short=True) for b in acts), _num(r.step_ms_predicted, ".1f"),
                      _bytes(r.comm_bytes_per_step),
                      " / ".join(_bytes(b, short=True) for b in d.get("model_state_bytes_per_device") or [])]
        t.add_row(*cells)
    return t


def layer_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok" and r.details.get("layer_activation_predicted")]


def _layout(d: dict) -> str:
    lay = d.get("layer_activation_layout") or {}
    if lay.get("t", 1) > 1:
        return f"tp {lay['t']}{' sp' if lay.get('sp') else ''}"
    return f"cp {lay['cp']}" if lay.get("cp", 1) > 1 else "one"


def layer_table(rows: list[Row]) -> Table | None:
    """One transformer layer's activations on one rank, measured (each storage once) beside the formula
    (parallel/activations.py) and its named terms: what tensor, sequence and context parallelism split."""
    chosen = layer_rows(rows)
    if not chosen:
        return None
    t = _table("Activations of one transformer layer on one rank: measured against the formula's terms",
               [("strategy", "left"), ("layout", "left"), ("measured", "right"), ("formula", "right"),
                ("off", "right"), ("whole", "right"), ("split", "right"), ("core", "right"), ("kernel", "left")])
    t.columns[0].min_width = 16
    for r in chosen:
        d = r.details
        terms, measured, predicted = d["layer_activation_terms"], d["layer_activation_bytes"], d[
            "layer_activation_predicted"]
        t.add_row(r.label, _layout(d), _bytes(measured, short=True), _bytes(predicted, short=True),
                  f"{measured / predicted - 1:+.1%}", _bytes(terms.get("whole"), short=True),
                  _bytes(terms.get("split"), short=True), _bytes(terms.get("core"), short=True),
                  (d.get("layer_activation_layout") or {}).get("kernel", "-"))
    return t


def layer_gaps(rows: list[Row]) -> list[str]:
    """Where one layer's measured activations are over the formula by more than 1%, which tensor."""
    out = []
    for r in layer_rows(rows):
        d = r.details
        extra = d["layer_activation_bytes"] - d["layer_activation_predicted"]
        if extra <= 0.01 * d["layer_activation_predicted"]:
            continue
        if n := d.get("layer_activation_gathered"):
            lay = d["layer_activation_layout"]
            out.append(f"{r.label}: {_bytes(extra)} over the formula: DTensor's sequence parallelism keeps the "
                       f"all-gathered input of its {n} column-parallel regions (q, k, v; mlp.0), "
                       f"{lay['b']} x {lay['s']} x {lay['h']} each, for backward, where Megatron keeps its 1/"
                       f"{lay['t']} and gathers it again.")
        else:
            out.append(f"{r.label}: {_bytes(extra)} over the formula, in no tensor it names.")
    return out


def context_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok" and "causal_pairs_per_rank" in r.details]


def _by_rank(values, show) -> str:
    return " ".join(show(v) for v in values or [] if v is not None) or "-"


def _ms(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def context_table(rows: list[Row]) -> Table | None:
    """Every context-parallel row: bytes per step beside the formula, each rank's causal (q, k) pairs and
    attention time (its layout's balance), and the activations a rank saves against 1/cp of one device's."""
    chosen = context_rows(rows)
    if not chosen:
        return None
    t = _table("Context parallel: bytes against the formula; each rank's causal pairs, attention time, activations",
               [("strategy", "left"), ("layout", "left"), ("cp", "right"), ("sent (formula)", "right"),
                ("causal pairs", "left"), ("attention ms", "left"), ("activations (1/cp of one)", "right")])
    t.columns[0].no_wrap = True  # a strategy's name whole
    for r in chosen:
        d = r.details
        cp = d.get("cp", r.world_size)
        single = _largest(d.get("single_activation_bytes_per_rank"))
        mine = _bytes(_largest(d.get("activation_bytes_per_rank")), short=True)
        t.add_row(r.strategy, f"{d.get('cp_layout', '-')} {d.get('cp_comm', '')}", str(cp),
                  f"{_bytes(r.comm_bytes_per_step, short=True)} ({_bytes(r.comm_bytes_predicted, short=True)})",
                  _by_rank(d["causal_pairs_per_rank"][:cp], _count),
                  _by_rank((d.get("attention_ms_per_rank") or [])[:cp], _ms),
                  f"{mine} ({_bytes(single / cp, short=True)})" if single else mine)
    return t


def expert_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok" and "rows_per_expert_per_layer_per_rank" in r.details]


def imbalance(d: dict) -> float | None:
    """The busiest expert's rows over the mean expert's, in the worst layer of the worst expert-parallel
    group (its ranks wait for it at the combine's all-to-all)."""
    ep, loads = d.get("ep", 1), d["rows_per_expert_per_layer_per_rank"]
    worst = None
    for g in range(0, len(loads), ep):
        for layer in range(len(loads[g])):
            rows = [n for rank in loads[g:g + ep] for n in rank[layer]]
            if rows and sum(rows):
                worst = max(worst or 0.0, max(rows) / (sum(rows) / len(rows)))
    return worst


def expert_table(rows: list[Row]) -> Table | None:
    """Every expert-parallel row: bytes beside the prediction from its routing, the share of routed rows
    that left their rank, the busiest expert against the mean and each rank's time in its experts, the
    share of assignments dropped past the capacity, and the expert parameters a rank holds against 1/ep of
    one device's. ep: "2x2" is ep 2 x dp 2."""
    chosen = expert_rows(rows)
    if not chosen:
        return None
    t = _table("Experts: bytes against the routing's prediction; balance, drops, expert parameters per rank",
               [("strategy", "left"), ("ep", "left"), ("cap.", "right"), ("sent (pred.)", "right"),
                ("away", "right"), ("max/mean", "right"), ("expert ms", "left"), ("dropped", "right"),
                ("experts (1/ep)", "right")])
    t.columns[0].no_wrap = True
    for r in chosen:
        d = r.details
        ep = d.get("ep", r.world_size)
        away = [v for v in d.get("rows_leaving_share_per_rank") or [] if v is not None]
        dropped, assigned = sum(d.get("dropped_assignments_per_rank") or [0]), sum(d.get("assignments_per_rank") or [0])
        held = _largest(d.get("expert_state_bytes_per_rank"))
        single = d.get("single_expert_state_bytes")
        t.add_row(r.strategy, f"{ep}x{r.world_size // ep}", _num(d.get("capacity_factor") or None, "g"),
                  f"{_bytes(r.comm_bytes_per_step, short=True)} ({_bytes(r.comm_bytes_predicted, short=True)})",
                  f"{sum(away) / len(away):.0%}" if away else "-", _num(imbalance(d), ".2f"),
                  _by_rank((d.get("expert_ms_per_step_per_rank") or [])[:ep], _ms),
                  f"{dropped / assigned:.1%}" if assigned and dropped else "0",
                  f"{_bytes(held, short=True)} ({_bytes(single / ep, short=True)})" if single else _bytes(held))
    return t


# Notes: at most about ten lines on a quiet machine; everything else in details.txt ---------------------


def _short(reason: str) -> str:
    """A skip reason's first clause: 'needs 4 devices or more (dp 2 x tp 2), cpu:2 has 2' -> 'needs 4 ...'."""
    first = re.split(r"[:;](?=\s)|, (?![^()]*\))", reason, maxsplit=1)[0]  # not a name's colon (file.py:factory)
    return re.sub(r"(\d+) devices or more", r"\1+ devices", re.sub(r"^it (has )?|\s*\([^()]*\)$", "", first.strip()))


def skipped_in_full(skipped: dict) -> list[str]:
    """Every skipped strategy with its whole reason, a line each (--wide, details.txt, `devices`)."""
    return [f"{name} skipped: {why}" for name, why in skipped.items()]


def skipped_line(skipped: dict) -> str | None:
    if not skipped:
        return None
    by: dict[str, list[str]] = {}
    for name, why in skipped.items():
        by.setdefault(_short(why), []).append(name)
    return "skipped: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in by.items())


def _span(values: list[float]) -> str:
    lo, hi = round(min(values) * 100), round(max(values) * 100)
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def flag_lines(rows: list[Row]) -> list[str]:
    """Flags, folded: every row measured under load in one line; the same kind of doubt about several rows
    in one line; other flags one line each (their full text is in details.txt)."""
    out = []
    loaded = [r for r in rows if any(f.startswith("noisy: other processes used") for f in r.flags)]
    if loaded:
        rounds = max((len(r.round_speedups) for r in rows), default=0)
        again = "re-run on a quiet machine" if rounds > 1 else "--repeat 3 pairs rounds, or re-run on a quiet machine"
        measured = len([r for r in rows if r.status == "ok"])
        who = f"all {measured} rows" if len(loaded) == measured else f"{len(loaded)} of {measured} rows" + (
            f" ({', '.join(r.label for r in loaded)})" if len(loaded) <= 3 else "")
        out.append(f"noisy: {who} measured while other processes used {_span([r.foreign_cpu for r in loaded])} "
                   f"of the CPU; {again}")
    over = [r for r in rows if any("from one measurement" in f for f in r.flags)]
    if over:
        out.append(", ".join(f"{r.label} {r.efficiency:.0%}" for r in over) + " efficiency from one measurement: "
                   "noise or a slow baseline (--repeat 3 tells)")
    folded = {id(r) for r in loaded + over}
    for r in rows:
        for f in r.flags:
            if (id(r) in folded and (f.startswith("noisy: other processes used") or "from one measurement" in f)):
                continue
            out.append(f"{r.label}: {f.split('; re-run')[0]}")
    return out


def notes(rows: list[Row], environment: dict, skipped: dict | None = None) -> list[str]:
    """What a reader must know to read the table right, in as few lines as it takes."""
    out = [f"{r.label} {r.status}: {r.error.splitlines()[0]}"  # the log: logs/round-k/ with --repeat
           + ("" if "log:" in r.error else f" (its traceback: {r.stem}.log in logs/)") for r in rows if r.error]
    out += [f"{r.label} mismatch: {r.equivalence.reason}" for r in rows if r.equivalence.verdict == "mismatch"]
    out += flag_lines(rows)
    if line := skipped_line(skipped or {}):
        out.append(line)
    for r in rows:
        if r.equivalence.verdict == "not-expected":
            ratio = ""
            base = next((b for b in rows if b.equivalence.verdict == "baseline"), None)
            if r.twin_blocks:  # single's eval loss is the twin's: the row's run on the twin against it
                ratio = f"; on the {twin.NAME}: {r.equivalence.reason.partition('converged instead: ')[2]}".rstrip(": ")
            elif base and base.eval_loss and r.eval_loss:
                ratio = f"; eval loss {r.eval_loss / base.eval_loss:.2f}x single's"
            why = r.details.get("not_expected") or "asynchronous, not the same training as one device"
            out.append(f"{r.label}: {why}{ratio}")
    judged: dict[str, list[str]] = {}  # rows judged by one looser rule are named together
    for r in rows:
        if r.equivalence.basis and r.equivalence.basis != "fp32 rule" and r.equivalence.verdict != "baseline":
            judged.setdefault(r.equivalence.basis, []).append(r.label)
    out += [f"{', '.join(labels)}: judged by {basis}" for basis, labels in judged.items()]
    kind = environment["device_kind"]
    if kind == "virtual":
        out.append(f"simulated: {environment['devices']} is virtual devices on {environment['cpu']['cores']} CPU "
                   "core(s): speedups are this CPU's, not a GPU's" + (" (more devices than cores)" if
                                                                    environment.get("oversubscribed") else ""))
    elif kind == "shared":
        out.append(f"shared: {environment['devices']} is ranks taking turns on one GPU (gloo): every CUDA path is "
                   "checked; speedups show what splitting costs")
    if why := environment.get("gpus_unusable"):
        out.append(f"GPUs not used: {why}")
    if kinds := sorted({r.device_kind for r in rows} & {"serial", "pass-through"}):
        out.append(" / ".join(kinds) + ": one device, nothing in parallel; the row costs the strategy's machinery")
    out += twin.notes(rows, skipped) or ["speedup: samples/s over single's (this run); eff.: speedup/devices; "
                                         "equivalence: error/tolerance"]
    return out


def long_notes(rows: list[Row], environment: dict, skipped: dict | None = None, cost_model: dict | None = None
               ) -> list[str]:
    """Everything the short notes fold or leave out, in full: for --wide and details.txt."""
    out = [f"{r.label} {r.status}: {r.error}" for r in rows if r.error]
    out += [f"{r.label}: {f}" for r in rows for f in r.flags]
    out += skipped_in_full(skipped or {})
    out += [f"{r.label}: {r.equivalence.reason}" for r in rows if r.equivalence.verdict == "not-expected"]
    out += sharded.notes(rows) + pipeline_gaps(rows) + layer_gaps(rows) + cost_lines(cost_model)
    kinds = {r.peak_mem_kind for r in rows if r.peak_mem_kind}
    if "process_peak_rss" in kinds:
        out.append("peak mem on CPU is the peak resident memory of rank 0's process (torch itself included); "
                   "every rank's and worker's is in the details, with the model state each device holds.")
    if rounds := max((len(r.round_speedups) for r in rows), default=0):
        over = next((r.speedup_over for r in rows if r.speedup_over), "`single`")  # harness/twin.py
        out.append(f"--repeat {rounds}: every strategy ran {rounds} times, in interleaved rounds; speedup is the "
                   f"median of each round's samples/s over that round's {over} [min-max over the rounds], ms "
                   "p50 the median of the rounds' (p95: the first round's); equivalence judged on the first round.")
    return out


def pipeline_gaps(rows: list[Row]) -> list[str]:
    """Why a pipeline row idled more than its schedule replayed on its own pieces (by over a quarter of
    it), or, where it was not replayed, than its closed form (which assumes equal stages)."""
    out = []
    for r in rows:
        m, busy = r.measured, r.details.get("stage_busy_ms")
        if r.status != "ok" or m.bubble_measured is None or not busy or len(busy) < 2:
            continue
        replayed = m.bubble_replayed is not None
        theory = (m.bubble_replayed if replayed else m.bubble_theory) or 0.0
        if m.bubble_measured <= theory * 1.25 or m.bubble_measured - theory <= 0.02:
            continue
        why = ("the replay has every piece's own time and the hand-offs, so the rest is the time between pieces: "
               "the schedule's own work (posting and waiting on sends and receives), which it does not price"
               if replayed else
               f"its stages were busy {' / '.join(f'{b:.1f}' for b in busy)} ms a step, and a faster stage waits for "
               "a slower one, which the closed form's equal stages leave out" if max(busy) > 1.1 * min(busy) else
               f"its stages were equally busy ({' / '.join(f'{b:.1f}' for b in busy)} ms), so the rest is what each "
               "of the m hand-offs costs (copies, queues, send/recv), which the closed form leaves out")
        out.append(f"{r.label}: idle {m.bubble_measured:.0%} of each step against {theory:.0%} "
                   f"{'replayed' if replayed else 'in theory'}: {why}.")
    return out


# The verdict --------------------------------------------------------------------------------------------


def _doubted(r: Row) -> bool:
    """A row whose speed the flags question: measured under load, or more than its devices can give."""
    return any(not f.startswith("real effect") for f in r.flags)


def advice(rows: list[Row]) -> list[str]:
    """Which strategy when, on this hardware, from this run's numbers (no sentence is fixed in advance).
    Only rows on several devices that trained like one device compete; `single` never does. The verdict
    is withheld when the measurements behind it are in doubt, and says what backs it when it is given:
    one measurement, or the median of paired rounds; rows it cannot tell apart are named with it."""
    ok = [r for r in rows if r.status == "ok" and r.speedup is not None and r.world_size > 1 and r.strategy != "single"]
    if not ok:
        if any(r.status == "ok" and r.world_size == 1 and r.strategy != "single" for r in rows):
            return ["One device: nothing here runs in parallel, so there is no layout to choose; the rows show what "
                    "each strategy's machinery costs against `single` (cuda:0x2 shares one GPU between 2 ranks)."]
        return []
    exact = [r for r in ok if r.equivalence.verdict == "match"]
    doubted = [r for r in ok if _doubted(r)]
    over = next((r.speedup_over for r in ok if r.speedup_over), "")  # speedups over a row: `single` did not fit
    out, named = [], set()  # named: rows the verdict has given already (the least slow and its ties)
    if not exact:
        out.append("No strategy on several devices trained like one device here: no fastest to name.")
    elif len(doubted) * 2 > len(ok):
        out.append(f"Withheld: {len(doubted)} of {len(ok)} rows are noisy or flagged, so their order is not "
                   "this hardware's; re-run on a quiet machine (with --repeat 3 for paired rounds).")
    else:
        clean = [r for r in exact if not _doubted(r)] or exact
        best = max(clean, key=lambda r: r.speedup)
        rounds = len(best.round_speedups)
        if rounds > 1:
            backed = f"median of {rounds} paired rounds, {min(best.round_speedups):.2f}-{max(best.round_speedups):.2f}"
            lo = min(best.round_speedups)
            ties = [r for r in clean if r is not best and len(r.round_speedups) > 1 and max(r.round_speedups) >= lo]
        else:
            backed = "one measurement"
            ties = [r for r in clean if r is not best and r.speedup >= 0.9 * best.speedup]
        noise = best.equivalence.basis.startswith("this model's own")  # noise.own_noise's rule
        like = "like one device, within the model's own rounding noise" if noise else "exactly like one device"
        like += f" on the {twin.NAME}" if over else ""
        if over:  # no one-device speed to be faster than: the fastest's own, which the speedups are over
            out.append(f"Fastest that trains {like}: {best.label}, {best.samples_per_s:,.0f} samples/s on "
                       f"{best.world_size} devices ({backed}); the speedups are over its samples/s.")
            named = {id(r) for r in (best, *ties)}
        elif best.speedup < 1:
            out.append(f"None trains {like} faster than one device here; the least slow: {best.label}, "
                       f"{best.speedup:.2f}x ({backed}).")
            named = {id(r) for r in (best, *ties)}
        else:
            out.append(f"Fastest that trains {like}: {best.label}, {best.speedup:.2f}x on {best.world_size} "
                       f"devices ({backed}).")
        if ties:
            out.append("Not told apart from it by this run: " + ", ".join(f"{r.label} {r.speedup:.2f}x" for r in ties)
                       + (" (their rounds overlap)." if rounds > 1 else " (within 10%, from one measurement)."))
        for r in ok:
            if r.equivalence.verdict == "not-expected" and r.speedup > best.speedup and not _doubted(r):
                out.append(f"Faster still: {r.label}, {r.speedup:.2f}x, but not the same training.")
    slower = [r for r in ok if r.speedup < 1 and not _doubted(r) and id(r) not in named]
    if slower:
        listed = ", ".join(f"{r.label} {r.speedup:.2f}x" for r in slower)
        out.append(f"{f'Slower than {over}' if over else 'Slower still' if named else 'Slower than one device here'}: "
                   f"{listed}.")
    for r in ok:
        m = r.measured
        if m.exposed_comm_ms is not None and m.exposed_comm_ms >= 0 and r.step_ms_p50 and not _doubted(r):
            out.append(f"{r.label}: {m.exposed_comm_ms / r.step_ms_p50:.0%} of each step is communication not "
                       f"hidden behind compute ({m.exposed_over_allreduce:.2f}x a bare all-reduce).")
    return out


# The cost model's lines ---------------------------------------------------------------------------------


def cost_lines(model: dict | None) -> list[str]:
    if not model or "projection" not in model:  # not calibrated (a shallow twin's run): the projection alone
        return memory_lines(model or {})
    ab = (f"all-reduce alpha {model['alpha_us']:.0f} us, beta {model['beta_ns_per_byte']:.2f} ns/B, "
          if model["alpha_us"] is not None else "")
    proj = model["projection"]
    gpus = ", ".join(f"{n} GPUs {us:.3g} us" for n, us in proj["us_by_gpus"].items())
    return [f"pred. ms: the cost model calibrated in this run ({ab}copy {model['copy_GB_per_s']:.1f} GB/s, compute "
            "measured per batch size): compute on one device's share + communication not hidden + bubble.",
            f"Projection, not measured: all-reduce of these gradients at the published {proj['busbw_GB_per_s']:.0f} "
            f"GB/s NCCL bus bandwidth (8xH200): {gpus} (optimistic across nodes)."] + memory_lines(model) + \
        ([model["planner"]["note"]] if "planner" in model else [])


def memory_lines(model: dict) -> list[str]:
    """--project-params: model state per GPU by ZeRO stage, and from how many GPUs it fits."""
    mem = model.get("memory_projection")
    if not mem:
        return []
    out = [f"Projection, not measured: {mem['what']}, for {mem['params']:.3g} parameters on "
           f"{mem['capacity_GiB']:g} GiB GPUs:"]
    for stage, gib in mem["GiB_by_stage"].items():
        fits = mem["fits_from_gpus"][stage]
        where = f"fits from {fits} GPU{'s' if fits > 1 else ''}" if fits else "never fits, at any count"
        out.append(f"  {stage}: " + ", ".join(f"{n} GPUs {g:.1f} GiB" for n, g in gib.items()) + f"; {where}")
    return out


# details.txt --------------------------------------------------------------------------------------------


def _unit(key: str) -> str:
    """What a detail's name says its number is: "bytes", "ms", "s", "fraction", or "" (nothing)."""
    if "bytes" in key or "rss" in key:
        return "bytes"
    if key.endswith("_ms"):
        return "ms"
    if key.endswith(("_s", "_seconds")):
        return "s"
    return "fraction" if "fraction" in key or key.startswith("bubble") else ""


def readable(key: str, value) -> str:
    """One detail as a person reads it: bytes in KiB/MiB, milliseconds with their unit, fractions as
    percentages, lists joined by ' / ', dicts as 'name value' pairs (a measurement family's result: each
    field by its own name, those it did not measure left out); never a Python repr."""
    if isinstance(value, dict):
        return ", ".join(f"{k} {readable(k if _unit(str(k)) else key, v)}" for k, v in value.items()
                         if v is not None) or "-"
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, (list, tuple)) for v in value):
            return f"{len(value)} entries"  # a timeline: in results.json and the pictures
        return " / ".join(readable(key, v) for v in value) or "-"
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if _unit(key) == "bytes":
        return _bytes(value)
    unit = _unit(key)
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "s":
        return f"{value:.3g} s"
    if unit == "fraction":
        return f"{value:.0%}"
    return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"


def details_text(rows: list[Row], environment: dict, skipped: dict | None = None,
                 cost_model: dict | None = None) -> str:
    """OUT/details.txt: the run, every row's measurements by name, and every note in full."""
    lines = [header(environment), ""]
    for r in rows:
        eq = r.equivalence
        lines.append(f"{r.label} ({r.launcher}, {r.world_size} {r.device_kind} device(s)): {r.status}")
        lines.append(f"  step ms p50 {_num(r.step_ms_p50, '.2f')} (p95 {_num(r.step_ms_p95, '.2f')}), predicted "
                     f"{_num(r.step_ms_predicted, '.2f')}; samples/s {_num(r.samples_per_s, ',.0f')}; speedup "
                     f"{_speedup(r)}; efficiency {_num(r.efficiency, '.0%')}")
        lines.append(f"  equivalence: {eq.verdict}" + (f", {eq.ratio:.3g} of its tolerance (worst: {eq.worst_tensor})"
                                                      if eq.ratio is not None else "")
                     + (f"; {eq.basis}" if eq.basis else "") + (f"; {eq.reason}" if eq.reason else ""))
        lines.append(f"  loss {_num(r.final_loss, '.4f')}, eval loss {_num(r.eval_loss, '.4f')}; peak memory "
                     f"{_bytes(r.peak_mem_bytes)} ({r.peak_mem_kind or '-'}); sent per step "
                     f"{_bytes(r.comm_bytes_per_step)} (textbook {_bytes(r.comm_bytes_predicted)})")
        measured = {k: v for k, v in dataclasses.asdict(r.measured).items() if v is not None}
        for k, v in {**r.details, **measured}.items():
            lines.append(f"  {k.replace('_', ' ')}: {readable(k, v)}")
        lines += [f"  flag: {f}" for f in r.flags]
        lines.append("")
    lines += ["Notes", *(f"- {n}" for n in long_notes(rows, environment, skipped, cost_model))]
    return "\n".join(lines) + "\n"


# The terminal -------------------------------------------------------------------------------------------


def show(rows: list[Row], environment: dict, console: Console | None = None, skipped: dict | None = None,
         cost_model: dict | None = None, wide: bool = False) -> None:
    console = console or make_console()
    console.print(header(environment), highlight=False, markup=False)
    if why := (environment.get("run") or {}).get("why"):  # the CLI chose the workload (GPUs, none named)
        console.print(why, style="dim", highlight=False, markup=False)
    console.print(table(rows, environment, wide, skipped))
    for extra in (*sharded.tables(rows), pipeline_table(rows, wide), layer_table(rows), context_table(rows),
                  expert_table(rows), memcheck.table(rows)):
        if extra is not None:
            console.print(extra)
    lines = notes(rows, environment, skipped) + (long_notes(rows, environment, skipped, cost_model) if wide else [])
    for line in lines:
        console.print(f"- {line}", style="dim", highlight=False, markup=False)
    if lines := advice(rows):
        console.print("[bold]Which strategy, on this hardware (from this run):[/]")
        for line in lines:
            console.print(f"  {line}", highlight=False, markup=False)


def make_console(wide: bool = False) -> Console:
    """A terminal's own width (or $COLUMNS); when written to a file or a pipe, 100 columns (`--wide`: 200)."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else 2 * WIDTH if wide else WIDTH)


def make_progress(console: Console | None = None) -> Progress:
    """The progress bar of every long command: what runs now, done/total, time elapsed."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)
