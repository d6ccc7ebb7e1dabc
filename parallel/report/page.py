"""OUT/report.html: the run in one self-contained page (its header, the main table, the notes and the
verdict, the pictures of report/pictures.py, links to the logs and traces; no script, no network);
Chromium's screenshot of it, which is how it is checked (tests/test_report.py, where Chromium is
installed); and `python -m parallel report OUT [--screenshot]`, which draws a finished run again."""

from __future__ import annotations

import html
import re
from pathlib import Path

from parallel.loop.results import Row, atomic_write
from parallel.measure import context_view, experts, pipelines, sharded_view
from parallel.report import notes, overview, report
from parallel.report.pictures import errors, speedup

STYLE = """body{font:14px/1.45 system-ui,sans-serif;max-width:60em;margin:1.5em auto;padding:0 1em;color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;text-align:right;border-bottom:1px solid #eee}
td:first-child,th:first-child{text-align:left}.dim{color:#666}svg{max-width:100%;height:auto}
.noisy{color:#b8860b}.bad{color:#c44e52;font-weight:bold}ul{padding-left:1.2em}code{background:#f4f4f4}"""


def _cell(text: str, cls: str = "") -> str:
    return f"<td class='{cls}'>{html.escape(text)}</td>" if cls else f"<td>{html.escape(text)}</td>"


def _main_table(rows: list[Row], environment: dict) -> str:
    """The terminal's main table (overview.main_cells), with the rounds' range beside each speedup."""
    out = ["<table><tr>" + "".join(f"<th>{h}</th>" for h, _ in overview.MAIN) + "</tr>"]
    for r in rows:
        *cells, eq, state = overview.main_cells(r, environment["device_kind"], spread=True)
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
    over = next((r.speedup_over for r in rows if r.speedup_over), "")  # judge/twin.py
    sections = [(f"Speedup over {over}" if over else "Speedup over one device", speedup(rows),
                 f"Each bar is samples/s over {over}'s, the fastest that matched on the shallow twin (`single` does "
                 "not fit one device)" if over else
                 "Each bar is samples/s over `single`'s in the same run; a range is the paired rounds' min-max."),
                ("Model state per rank, by kind", sharded_view.memory(rows),
                 "Params, grads and optimizer state each rank holds (measured), beside the ZeRO paper's formula for "
                 "the strategy."),
                ("Pipeline stages: model state and activations", pipelines.stage_memory(rows),
                 "What each stage holds: its part of the model state, and the most activations it kept at once."),
                ("Bytes sent per step, by collective",
                 sharded_view.collectives([r for r in rows if r not in pipelines.rows(rows)]),
                 "What one rank sends in an optimiser step, counted at the collective; the tick: the textbook's."),
                ("Context parallel: each rank's attention work", context_view.picture(rows),
                 "The causal pairs each rank's positions give it (zig-zag: equal; contiguous: the last rank the "
                 "most), and its attention time measured alone."),
                ("Context parallel: the ring's bytes against the all-to-all's", context_view.crossing(rows),
                 "What a rank sends for attention in a step, by formula at each number of ranks splitting the "
                 "sequence, for this run's shape: the ring's K,V blocks stay near constant, the all-to-all's fall as "
                 "1/P. Dots: what each row sent besides its gradients' all-reduce."),
                ("Experts: each rank's load", experts.picture(rows),
                 "The rows each rank's experts computed (one colour per expert) and its time in them: the busiest "
                 "rank sets the step, since every rank waits for it at the combine's all-to-all.")]
    sections += pipelines.pictures(rows)
    sections.append(("Equivalence: every tensor against one device", errors(rows),
                     "Each dot is one tensor's largest difference from `single`'s over its own tolerance."))
    body = [f"<h1>{html.escape(overview.header(environment))}</h1>", _main_table(rows, environment)]
    body.append("<ul class='dim'>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes.notes(
        rows, environment, skipped)) + "</ul>")
    if lines := notes.advice(rows):
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
