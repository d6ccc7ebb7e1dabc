"""The report: one screen on the terminal (`show`: 100 columns; `--wide` for every column and note), every
row's details and every note in full in OUT/details.txt (`details_text`), beside results.json/.csv and
OUT/report.html (report/page.py). The header and the main table are report/overview.py's, the notes and
the verdict report/notes.py's; the tables of the measurement families are here.

Every table keeps to 100 columns: what does not fit goes behind `--wide` and into the files. Cells wrap
rather than being cut (`overflow="fold"`), so no number is ever shown half; tests/test_report.py renders
at 80, 100 and 120 columns and looks for a cut."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from parallel.loop.results import Row
from parallel.measure import context, context_view, experts, layers, pipelines, sharded, sharded_view
from parallel.report import memcheck
from parallel.report.notes import advice, cost_lines, notes, skipped_in_full
from parallel.report.overview import header, speedup_text, table
from parallel.style.tables import num as _num
from parallel.style.tables import size as _bytes
from parallel.style.terminal import make_console

# The sharded and pipeline tables ------------------------------------------------------------------------


# details.txt --------------------------------------------------------------------------------------------


def long_notes(rows: list[Row], environment: dict, skipped: dict | None = None, cost_model: dict | None = None
               ) -> list[str]:
    """Everything the short notes fold or leave out, in full: for --wide and details.txt."""
    out = [f"{r.label} {r.status}: {r.error}" for r in rows if r.error]
    out += [f"{r.label}: {f}" for r in rows for f in r.flags]
    out += skipped_in_full(skipped or {})
    out += [f"{r.label}: {r.equivalence.reason}" for r in rows if r.equivalence.verdict == "not-expected"]
    out += sharded_view.notes(rows) + pipelines.gaps(rows) + layers.layer_gaps(rows) + cost_lines(cost_model)
    kinds = {r.peak_mem_kind for r in rows if r.peak_mem_kind}
    if "process_peak_rss" in kinds:
        out.append("peak mem on CPU is the peak resident memory of rank 0's process (torch itself included); "
                   "every rank's and worker's is in the details, with the model state each device holds.")
    if rounds := max((len(r.round_speedups) for r in rows), default=0):
        over = next((r.speedup_over for r in rows if r.speedup_over), "`single`")  # judge/twin.py
        out.append(f"--repeat {rounds}: every strategy ran {rounds} times, in interleaved rounds; speedup is the "
                   f"median of each round's samples/s over that round's {over} [min-max over the rounds], ms "
                   "p50 the median of the rounds' (p95: the first round's); equivalence judged on the first round.")
    return out


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


FAMILIES = {m.Result.FAMILY for m in (sharded, pipelines, layers, context, experts)}  # their typed results' keys


def _flat(details: dict) -> dict:
    """A row's details with each family's typed result opened in place: a line for each thing it measured."""
    out = {}
    for k, v in details.items():
        out |= {f: x for f, x in v.items() if x is not None} if k in FAMILIES and isinstance(v, dict) else {k: v}
    return out


def details_text(rows: list[Row], environment: dict, skipped: dict | None = None,
                 cost_model: dict | None = None) -> str:
    """OUT/details.txt: the run, every row's measurements by name, and every note in full."""
    lines = [header(environment), ""]
    for r in rows:
        eq = r.equivalence
        lines.append(f"{r.label} ({r.launcher}, {r.world_size} {r.device_kind} device(s)): {r.status}")
        lines.append(f"  step ms p50 {_num(r.step_ms_p50, '.2f')} (p95 {_num(r.step_ms_p95, '.2f')}), predicted "
                     f"{_num(r.step_ms_predicted, '.2f')}; samples/s {_num(r.samples_per_s, ',.0f')}; speedup "
                     f"{speedup_text(r)}; efficiency {_num(r.efficiency, '.0%')}")
        lines.append(f"  equivalence: {eq.verdict}" + (f", {eq.ratio:.3g} of its tolerance (worst: {eq.worst_tensor})"
                                                      if eq.ratio is not None else "")
                     + (f"; {eq.basis}" if eq.basis else "") + (f"; {eq.reason}" if eq.reason else ""))
        lines.append(f"  loss {_num(r.final_loss, '.4f')}, eval loss {_num(r.eval_loss, '.4f')}; peak memory "
                     f"{_bytes(r.peak_mem_bytes)} ({r.peak_mem_kind or '-'}); sent per step "
                     f"{_bytes(r.comm_bytes_per_step)} (textbook {_bytes(r.comm_bytes_predicted)})")
        measured = {k: v for k, v in dataclasses.asdict(r.measured).items() if v is not None}
        for k, v in {**_flat(r.details), **measured}.items():
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
    for extra in (*sharded_view.tables(rows), pipelines.table(rows, wide), layers.layer_table(rows),
                  context_view.table(rows), experts.table(rows), memcheck.table(rows)):
        if extra is not None:
            console.print(extra)
    lines = notes(rows, environment, skipped) + (long_notes(rows, environment, skipped, cost_model) if wide else [])
    for line in lines:
        console.print(f"- {line}", style="dim", highlight=False, markup=False)
    if lines := advice(rows):
        console.print("[bold]Which strategy, on this hardware (from this run):[/]")
        for line in lines:
            console.print(f"  {line}", highlight=False, markup=False)
