"""OUT/report.html: the run's pictures in one self-contained file (inline SVG from matplotlib, no script,
no network): speedup with its spread, model state per rank stacked by kind beside the ZeRO formula,
bytes by collective, each pipeline's measured schedule beside the schedule played out, and each
strategy's error over its tolerance per tensor; links to the traces and the logs.

`python -m parallel screenshot OUT` (scripts/screenshot.py) opens it in headless Chromium and saves
OUT/report.png, which is how it is checked (tests/test_report.py, where Chromium is installed)."""

from __future__ import annotations

import html
import re
from pathlib import Path

from parallel.charts import height as _height
from parallel.charts import plt as _plt
from parallel.charts import stacked as _stacked
from parallel.charts import svg as _svg
from parallel.harness import report
from parallel.measure import sharded
from parallel.results import Row, atomic_write

VERDICT_COLOR = {"match": "#55a868", "baseline": "#4c72b0", "not-expected": "#dd8452", "mismatch": "#c44e52",
                 "unchecked": "#999999"}
PIECE_COLOR = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#8172b3", "L": "#55a868"}


# The figures --------------------------------------------------------------------------------------------


def speedup(rows: list[Row]) -> str | None:
    """Speedup over `single` per row: a bar (hollow where the row is noisy or flagged), the [min-max] of
    paired rounds where there are rounds, and a tick at the ideal (the device count)."""
    shown = [r for r in rows if r.status == "ok" and r.speedup is not None]
    if not shown:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, _height(len(shown))))
    over = next((r.speedup_over for r in shown if r.speedup_over), "")  # `single` did not fit: over this row
    for i, r in enumerate(shown):
        color = VERDICT_COLOR.get(r.equivalence.verdict, "#999999")
        doubted = report.status(r) != "ok"
        ax.barh(i, r.speedup, color="none" if doubted else color, edgecolor=color, hatch="//" if doubted else None,
                linewidth=1.2)
        if len(r.round_speedups) > 1:
            lo, hi = min(r.round_speedups), max(r.round_speedups)
            ax.errorbar(r.speedup, i, xerr=[[r.speedup - lo], [hi - r.speedup]], color="black", capsize=3, lw=1)
        if not over:  # the ideal is the device count only over one device
            ax.plot([r.world_size, r.world_size], [i - 0.4, i + 0.4], color="#333333", lw=1.5, ls=":")
        ax.text(r.speedup, i, f" {r.speedup:.2f}x" + (" (noisy)" if doubted else ""), va="center", fontsize=8)
    ax.axvline(1.0, color="#777777", lw=0.8)
    ax.set_yticks(range(len(shown)), [r.label for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel(f"samples/s over {over}'s, the fastest that matched (single does not fit); hollow: noisy/flagged"
                  if over else "speedup over `single` (samples/s ratio, this run); dotted: ideal = devices; hollow: "
                  "noisy/flagged")
    return _svg(fig)


def _per_rank(value, ranks: int) -> list:
    if isinstance(value, list):
        return value + [None] * (ranks - len(value))
    return [value] * ranks


def stage_memory(rows: list[Row]) -> str | None:
    """Each pipeline stage's model state and the activations it held at once (its own scale: activations
    dwarf a small model's state)."""
    bars = []
    for r in report.pipeline_rows(rows):
        d = r.details
        state = d.get("model_state_bytes_per_device") or []
        acts = d.get("stage_peak_activation_bytes") or d.get("stage_activation_bytes") or []
        for k in range(max(len(state), len(acts))):
            bars.append((f"{r.label} stage {k}", {"model state": state[k] if k < len(state) else None,
                                                  "activations": acts[k] if k < len(acts) else None}, None))
    return _stacked(bars)


def _per_rank_figure(labels: list[str], ms: list, left_label: str, right_label: str):
    """Two panels sharing one row per rank: the caller draws bars on the left (returned), and the time on
    the right as dots."""
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, _height(len(labels))), sharey=True)
    left.set_xlabel(left_label)
    right.plot([v or 0 for v in ms], range(len(labels)), "o", color="#dd8452")
    right.set_xlabel(right_label)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    return fig, left


def context(rows: list[Row]) -> str | None:
    """Each context-parallel row's ranks: the causal (q, k) pairs its layout gives them (bars, left) and
    the attention time measured on them (dots, right)."""
    chosen = report.context_rows(rows)
    if not chosen:
        return None
    bars = [(f"{r.label} rank {k}", pairs, ms) for r in chosen for k, (pairs, ms) in enumerate(zip(
        r.details["causal_pairs_per_rank"][:r.details.get("cp", r.world_size)],
        _per_rank(r.details.get("attention_ms_per_rank"), r.world_size), strict=False))]
    fig, left = _per_rank_figure([b[0] for b in bars], [b[2] for b in bars],
                                 "causal (q, k) pairs per head and sequence",
                                 "attention ms (forward + backward, no communication)")
    left.barh(range(len(bars)), [b[1] for b in bars], color="#4c72b0")
    return _svg(fig)


def experts(rows: list[Row]) -> str | None:
    """Each expert-parallel row's ranks: the rows its experts computed per step, every layer summed, one
    segment per expert (bars, left), and the time it spent in them (dots, right): the busiest rank sets
    the pace, since every rank waits for it at the combine's all-to-all."""
    chosen = report.expert_rows(rows)
    if not chosen:
        return None
    bars = []
    for r in chosen:
        d = r.details
        ms = _per_rank(d.get("expert_ms_per_step_per_rank"), r.world_size)
        for k, layers in enumerate(d["rows_per_expert_per_layer_per_rank"][:d.get("ep", r.world_size)]):
            held = d["experts_per_rank"][k]
            bars.append((f"{r.label} rank {k}", held, [sum(layer[j] for layer in layers) for j in range(len(held))],
                         ms[k] if k < len(ms) else None))
    fig, left = _per_rank_figure([b[0] for b in bars], [b[3] for b in bars],
                                 "rows its experts computed per step (every layer)", "ms in its experts per step")
    colours = _plt().get_cmap("tab10").colors
    for y, (_, held, counts, _) in enumerate(bars):
        start = 0.0
        for expert, n in zip(held, counts, strict=True):
            left.barh(y, n, left=start, color=colours[expert % 10], edgecolor="white")
            left.text(start + n / 2, y, f"e{expert}", ha="center", va="center", fontsize=7, color="white")
            start += n
    return _svg(fig)


def pieces(timeline: list) -> list[tuple[int, float, float, str, int]]:
    """(row of the chart, start ms, end ms, kind, micro-batch) from a row's stage_timeline or replay_timeline:
    in-process pipelines give one list per stage; pipeline_dist one list per rank, whose labels name the stage."""
    from parallel.measure.stage_time import PIECE

    out = []
    for lane, intervals in enumerate(timeline):
        for start, end, label in intervals:
            if m := PIECE.search(str(label)):
                out.append((lane, float(start), float(end), m.group(2), int(m.group(3))))
    return out


def gantt(r: Row) -> str | None:
    """The row's last step as each stage (or rank) spent it, beside every rank's actions replayed on the
    medians of those same pieces and the measured hand-offs (replay.pipeline_theory): the gap between
    the two is what the replay leaves out (the time between pieces: the schedule's own work, waiting)."""
    measured = pieces(r.details.get("stage_timeline") or [])
    if not measured:
        return None
    lanes = max(p[0] for p in measured) + 1
    theory = pieces(r.details.get("replay_timeline") or [])
    plt = _plt()
    panels = [("measured: the last step", measured)] + ([("replayed: every rank's actions on the median pieces",
                                                           theory)] if theory else [])
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 0.8 + 0.45 * lanes * len(panels) + 0.4 * len(panels)),
                             sharex=True, squeeze=False)
    for ax, (title, ps) in zip(axes[:, 0], panels, strict=True):
        t0 = min(b for _, b, _, _, _ in ps)
        for lane, b, e, kind, j in ps:
            ax.barh(lane, e - b, left=b - t0, color=PIECE_COLOR[kind], edgecolor="white", linewidth=0.5)
            if e - b > 0:
                ax.text(b - t0 + (e - b) / 2, lane, f"{kind}{j}", ha="center", va="center", fontsize=7, color="white")
        ax.set_yticks(range(lanes), [f"{'rank' if 'schedule' in r.details and r.strategy != 'pipeline' else 'stage'} "
                                     f"{k}" for k in range(lanes)])
        ax.invert_yaxis()
        ax.set_title(title, fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("ms since the step's first piece of work (F forward, L loss, B backward, I input gradient, "
                           "W weight gradient)")
    return _svg(fig)


def errors(rows: list[Row]) -> str | None:
    """Every tensor's difference from `single`'s over its tolerance, per strategy (log scale; 1 is the
    tolerance): how close each came, and which tensors a mismatch is in."""
    shown = [r for r in rows if r.equivalence.per_tensor]
    if not shown:
        return None
    plt = _plt()
    floor = 1e-6
    fig, ax = plt.subplots(figsize=(7.5, _height(len(shown))))
    for i, r in enumerate(shown):
        values = [max(v, floor) for v in r.equivalence.per_tensor.values() if v == v and v != float("inf")]
        color = VERDICT_COLOR.get(r.equivalence.verdict, "#999999")
        ax.scatter(values, [i] * len(values), s=12, color=color, alpha=0.7)
        if r.equivalence.worst_tensor:
            ax.text(max(values + [floor]), i + 0.3, f" {r.equivalence.worst_tensor}", fontsize=7, va="center")
    ax.axvline(1.0, color="#c44e52", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, max(10.0, max(max(r.equivalence.per_tensor.values()) for r in shown) * 2))
    ax.set_yticks(range(len(shown)), [r.label for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel(f"difference from `single` over its tolerance, one dot a tensor (1: the tolerance; {floor:g}: exact)")
    return _svg(fig)


# The page -----------------------------------------------------------------------------------------------


STYLE = """body{font:14px/1.45 system-ui,sans-serif;max-width:60em;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #eee}
td:first-child,th:first-child{text-align:left}.dim{color:#666}svg{max-width:100%;height:auto}
.noisy{color:#b8860b}.bad{color:#c44e52;font-weight:bold}ul{padding-left:1.2em}code{background:#f4f4f4}"""


def _cell(text: str, cls: str = "") -> str:
    return f"<td class='{cls}'>{html.escape(text)}</td>" if cls else f"<td>{html.escape(text)}</td>"


def _main_table(rows: list[Row], environment: dict) -> str:
    """The terminal's main table (report.main_cells), with the rounds' range beside each speedup."""
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h, _ in report.MAIN) + "</tr>"]
    for r in rows:
        *cells, eq, state = report.main_cells(r, environment["device_kind"], spread=True)
        eq_class = "bad" if r.equivalence.verdict == "mismatch" else ""
        state_class = "" if state == "ok" else "bad" if r.status != "ok" else "noisy"
        out.append("<tr>" + "".join([*map(_cell, cells), _cell(eq, eq_class), _cell(state, state_class)]) + "</tr>")
    return "\n".join(out) + "</table>"


def _links(out: Path) -> str:
    items = [("details.txt", "every row's measurements and every note"), ("results.json", "everything, for code"),
             ("results.csv", "one row a strategy"), ("timeline.json", "every rank of every strategy on one clock, "
                                                      "each strategy from t = 0 (open in ui.perfetto.dev)")]
    links = [f"<li><a href='{name}'>{name}</a>: {what}</li>" for name, what in items if (out / name).exists()]
    links += [f"<li><a href='logs/{p.name}'>logs/{p.name}</a></li>" for p in sorted((out / "logs").glob("*.log"))]
    traces = sorted((out / "tb").glob("*/*.pt.trace.json")) if (out / "tb").is_dir() else []
    if traces:
        links.append(f"<li>profiler traces, one a rank (TensorBoard: <code>./launch.sh tensorboard "
                     f"{html.escape(str(out))}</code>): " + ", ".join(
                         f"<a href='{p.relative_to(out)}'>{p.parent.name}/{p.name.split('.')[0]}</a>" for p in traces)
                     + "</li>")
    return "<ul>" + "\n".join(links) + "</ul>" if links else "<p class='dim'>no files beside it</p>"


def page(rows: list[Row], environment: dict, skipped: dict | None, out: Path) -> str:
    over = next((r.speedup_over for r in rows if r.speedup_over), "")  # harness/twin.py
    sections = [(f"Speedup over {over}" if over else "Speedup over one device", speedup(rows),
                 f"Each bar is samples/s over {over}'s, the fastest that matched on the shallow twin (`single` does "
                 "not fit one device)" if over else
                 "Each bar is samples/s over `single`'s in the same run; a range is the paired rounds' min-max."),
                ("Model state per rank, by kind", sharded.memory(rows),
                 "Params, grads and optimizer state each rank holds (measured), beside the ZeRO paper's formula for "
                 "the strategy."),
                ("Pipeline stages: model state and activations", stage_memory(rows),
                 "What each stage holds: its part of the model state, and the most activations it kept at once."),
                ("Bytes sent per step, by collective",  # the pipelines' sends are in their own table
                 sharded.collectives([r for r in rows if r not in report.pipeline_rows(rows)]),
                 "What one rank sends in an optimiser step, counted at the collective; the tick: the textbook's."),
                ("Context parallel: each rank's attention work", context(rows),
                 "The causal pairs each rank's positions give it (zig-zag: equal; contiguous: the last rank the "
                 "most), and its attention time measured alone."),
                ("Experts: each rank's load", experts(rows),
                 "The rows each rank's experts computed (one colour per expert) and its time in them: the busiest "
                 "rank sets the step, since every rank waits for it at the combine's all-to-all.")]
    sections += [(f"Pipeline schedule: {r.label}", gantt(r), f"{r.details.get('schedule', 'one stage at a time')}, "
                  f"m = {r.details.get('microbatches', 1)}, stages {r.details.get('stages', '')}: idle "
                  f"{report._pct(r.measured.bubble_measured)} measured, "
                  f"{report._pct(r.measured.bubble_replayed)} replayed")
                 for r in report.pipeline_rows(rows)]
    sections.append(("Equivalence: every tensor against one device", errors(rows),
                     "Each dot is one tensor's largest difference from `single`'s over its own tolerance."))
    body = [f"<h1>{html.escape(report.header(environment))}</h1>", _main_table(rows, environment)]
    body.append("<ul class='dim'>" + "".join(f"<li>{html.escape(n)}</li>" for n in report.notes(
        rows, environment, skipped)) + "</ul>")
    if lines := report.advice(rows):
        body.append("<h2>Which strategy, on this hardware (from this run)</h2><ul>"
                    + "".join(f"<li>{html.escape(line)}</li>" for line in lines) + "</ul>")
    for title, svg, caption in sections:
        if svg:
            body.append(f"<h2>{html.escape(title)}</h2><p class='dim'>{html.escape(caption)}</p>{svg}")
    body.append(f"<h2>Files</h2>{_links(out)}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>parallel: "
            f"{html.escape(environment['devices'])}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")


def write(path: Path, rows: list[Row], environment: dict, skipped: dict | None = None) -> Path:
    """OUT/report.html, written atomically."""
    path = Path(path)
    atomic_write(path, page(rows, environment, skipped, path.parent))
    return path


CHROMIUMS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


def browser() -> str | None:
    """A Chromium on PATH (Debian's package: `apt-get install chromium`), or None."""
    import shutil

    return next((found for name in CHROMIUMS if (found := shutil.which(name))), None)


def page_height(text: str) -> int:
    """About how tall report.html draws, in pixels: its pictures (matplotlib's SVG sizes, in points,
    scaled as the page's 60em column scales them) and a margin for its text and tables."""
    heights = [float(h) * 4 / 3 for h in re.findall(r'<svg[^>]*?height="([\d.]+)pt"', text)]
    return int(sum(heights) * 0.95 + 120 * len(heights) + 30 * text.count("<tr>") + 30 * text.count("<li>") + 300)


def screenshot(page: Path, png: Path, width: int = 1100, height: int | None = None, timeout: float = 60.0) -> Path:
    """`page` rendered by headless Chromium into `png` (the whole page: `height` pixels, by default
    page_height's estimate), with no network: how report.html is checked. Raises RuntimeError with
    Chromium's last words if it fails."""
    import subprocess
    import tempfile

    height = height or page_height(Path(page).read_text())

    exe = browser()
    if exe is None:
        raise RuntimeError("no Chromium on PATH (Debian: apt-get install chromium)")
    png = Path(png).resolve()
    with tempfile.TemporaryDirectory(prefix="parallel-chromium-") as profile:
        p = subprocess.run([exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                            f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9",  # no network
                            "--proxy-bypass-list=<-loopback>",
                            f"--window-size={width},{height}", f"--screenshot={png}", Path(page).resolve().as_uri()],
                           capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0 or not png.exists():
        raise RuntimeError(f"chromium exited {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}")
    return png


def render(out: Path, console, wide: bool = False, png: bool = False) -> int:
    """`python -m parallel report OUT`: the report of a finished run again from its results.json (the
    terminal's, --wide's, details.txt and report.html), and with --screenshot report.png from Chromium."""
    import json

    from parallel.config import ConfigError

    out = Path(out)
    try:
        doc = json.loads((out / "results.json").read_text())
        rows = [Row.from_dict(r) for r in doc["rows"]]
        env, skipped, cost_model = doc["environment"], doc.get("skipped") or {}, doc.get("cost_model")
    except FileNotFoundError:
        raise ConfigError(f"{out}/results.json: no such file (a results folder of compare or run)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{out}/results.json: not a results file of this version ({e})") from None
    report.show(rows, env, console, skipped, cost_model, wide=wide)
    atomic_write(out / "details.txt", report.details_text(rows, env, skipped, cost_model))
    page_path = write(out / "report.html", rows, env, skipped)
    console.print(f"written: {out}/details.txt, {page_path}", highlight=False, markup=False)
    if png:
        try:
            console.print(f"screenshot: {screenshot(page_path, out / 'report.png')}", highlight=False, markup=False)
        except (RuntimeError, OSError) as e:
            raise ConfigError(f"screenshot: {e}") from None
    return 0
