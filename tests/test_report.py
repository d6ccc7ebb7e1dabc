"""The report a person reads: one screen at 100 columns with nothing cut, a header naming the run, notes
that fold, a verdict that is withheld under noise and never names `single`, details.txt without Python
reprs, and report.html: self-contained, with its pictures, drawn by a real browser where one is installed.

The fixture is a real `./launch.sh compare --profile` on cpu:2 (tests/data/compare_cpu2.json)."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest
from rich.console import Console

from parallel import cli, compare
from parallel.loop.results import Equivalence, Measured, Row
from parallel.report import notes, overview, page, report
from tests.conftest import ROOT

FIXTURE = ROOT / "tests" / "data" / "compare_cpu2.json"


def load(quiet: bool = True):
    doc = json.loads(FIXTURE.read_text())
    rows = [Row.from_dict(r) for r in doc["rows"]]
    if quiet:  # the fixture's machine was busy; most tests want a quiet one
        for r in rows:
            r.foreign_cpu, r.flags = 0.0, []
    return rows, doc["environment"], doc["skipped"], doc["cost_model"]


def render(width: int, rows, env, skipped=None, wide=False) -> str:
    console = Console(width=width, record=True, file=open("/dev/null", "w"))  # noqa: SIM115
    report.show(rows, env, console, skipped, wide=wide)
    return console.export_text()


def main_table(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().startswith("strategy"))
    end = next(i for i in range(start + 2, len(lines)) if not lines[i].strip())
    return lines[start + 2:end]


@pytest.mark.parametrize("width", [80, 100, 120])
def test_no_cell_is_cut(width):
    rows, env, skipped, _ = load()
    rows.append(dataclasses.replace(rows[1], strategy="zero_optimizer", variant="", status="timed-out",
                                    equivalence=Equivalence("not-expected", ratio=None)))
    text = render(width, rows, env, skipped)
    assert "…" not in text and max(map(len, text.splitlines())) <= width
    if width >= 100:  # every row on one line, every value whole
        lines = main_table(text)
        assert len(lines) == len(rows)
        for r, line in zip(rows, lines, strict=True):
            cells = [r.label, f"{r.step_ms_p50:.1f}", f"{r.speedup:.2f}" if r.speedup else "-", r.equivalence.verdict,
                     overview.status(r)]
            assert all(c in line for c in cells), (line, cells)


def test_the_header_names_the_run_and_nothing_is_a_python_repr():
    rows, env, skipped, cost = load()
    text = render(100, rows, env, skipped)
    head = text.splitlines()[0]
    run = env["run"]
    for part in (run["workload"], "params", f"batch {run['global_batch']}", f"{run['steps']} steps", env["devices"],
                 run["precision"], f"seed {run['seed']}", f"torch {env['torch']}"):
        assert part in head, part
    details = report.details_text(rows, env, skipped, cost)
    for out in (text, details, render(100, rows, env, skipped, wide=True)):
        assert not re.search(r"[\[{]'|\d\.\d{7,}|\[\d+, \d+", out), re.search(r"[\[{]'|\d\.\d{7,}|\[\d+, \d+", out)
    assert "bytes per step by collective: all_gather 129 KiB, reduce_scatter 64.4 KiB" in details


def test_notes_fold_to_about_ten_lines_and_repeats_into_one():
    rows, env, skipped, _ = load()
    lines = [line for line in render(100, rows, env, skipped).splitlines() if line.startswith("- ")]
    assert len(lines) <= 10
    assert sum(line.startswith("- skipped:") for line in lines) == 1
    rows, env, skipped, _ = load(quiet=False)  # the fixture as measured: most rows under load
    compare.flag(rows)
    text = render(100, rows, env, skipped)
    noisy = [line for line in text.splitlines() if "noisy" in line and line.startswith("- ")]
    assert len(noisy) == 1 and "of the CPU" in noisy[0] and "--repeat" in noisy[0]


def test_a_skip_or_a_failure_is_one_line_with_its_reason():
    why = "cannot split the m.py:llama over 4 ranks: tp 4 does not divide k_proj's 2 heads"
    assert notes.skipped_line({"manual_tp": why, "fsdp_tp": "needs 4 devices or more (dp 2 x tp 2), cpu:2 has 2"}) \
        == "skipped: manual_tp (cannot split the m.py:llama over 4 ranks); fsdp_tp (needs 4+ devices)"
    failed = dataclasses.replace(row("ddp", 1.0), status="failed", error="rank 1: RuntimeError: boom\nmore")
    env = {"device_kind": "real"}
    assert notes.notes([failed], env)[0] == "ddp failed: rank 1: RuntimeError: boom (its traceback: ddp.log in logs/)"


def row(name, speedup, verdict="match", world=2, flags=(), rounds=()):
    return Row(name, "", "x", "cpu:2", "virtual", world, 64, samples_per_s=speedup * 100, speedup=speedup,
               efficiency=speedup / world, step_ms_p50=10.0, eval_loss=1.0, flags=list(flags),
               round_speedups=list(rounds), equivalence=Equivalence(verdict))


def test_the_verdict_never_names_single_and_is_withheld_under_noise():
    slower = [row("single", 1.0, "baseline", world=1), row("ddp", 0.8), row("fsdp", 0.6)]
    text = "\n".join(notes.advice(slower))
    assert "Fastest" not in text and "the least slow: ddp, 0.80x" in text and "single," not in text
    assert "Slower still: fsdp 0.60x." in text and "ddp 0.80x" not in text  # the least slow is named once
    noisy = "noisy: other processes used 60% of the machine's CPU"
    rows = [row("single", 1.0, "baseline", world=1), row("ddp", 1.9, flags=[noisy]), row("zero", 1.5, flags=[noisy]),
            row("manual_dp", 1.2)]
    assert notes.advice(rows)[0].startswith("Withheld: 2 of 3 rows are noisy or flagged")
    rows[1].flags = []  # ddp measured clean: it is named, and the noisy zero is not compared with it
    assert "ddp, 1.90x on 2 devices (one measurement)" in notes.advice(rows)[0]


def test_the_verdict_says_what_backs_it_and_what_it_cannot_tell_apart():
    rows = [row("single", 1.0, "baseline", world=1), row("ddp", 1.8, rounds=[1.6, 1.8, 1.9]),
            row("zero", 1.7, rounds=[1.5, 1.7, 1.65]), row("fsdp", 1.2, rounds=[1.1, 1.2, 1.25])]
    lines = notes.advice(rows)
    assert "ddp, 1.80x on 2 devices (median of 3 paired rounds, 1.60-1.90)" in lines[0]
    assert lines[1] == "Not told apart from it by this run: zero 1.70x (their rounds overlap)."


def test_impossible_measurements_are_flagged():
    r = row("ddp", 1.5)
    r.measured = Measured(exposed_comm_ms=-48.8, exposed_over_allreduce=-3.0)
    compare.flag([row("single", 1.0, "baseline", world=1), r])
    assert any("exposed communication measured -48.8 ms" in f for f in r.flags)
    assert overview.status(r) == "flag" and not any("communication not hidden" in a for a in notes.advice([r]))


def test_report_html_is_self_contained_with_every_picture(tmp_path):
    rows, env, skipped, _ = load()
    html = page.write(tmp_path / "report.html", rows, env, skipped).read_text()
    assert not re.search(r"""(src|href)=['"]?(https?:)?//""", html) and "<script" not in html
    for title in ("Speedup over one device", "Model state per rank, by kind", "Bytes sent per step, by collective",
                  "Pipeline schedule: pipeline_dist", "measured: the last step", "Equivalence: every tensor"):
        assert title in html, title
    assert html.count("<svg") >= 8


@pytest.mark.slow  # a browser's start and a page of charts drawn: 8-13 s
@pytest.mark.skipif(page.browser() is None, reason="no Chromium on PATH (Debian: apt-get install chromium)")
def test_report_html_drawn_by_headless_chromium(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "results.json").write_text(FIXTURE.read_text())
    p = subprocess.run([sys.executable, "-m", "parallel", "report", str(out), "--screenshot"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    png = (out / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 100_000  # a page of charts, not a blank one
    assert (out / "details.txt").exists()


def test_report_of_a_folder_without_results_is_one_line(tmp_path, capfd):
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "results.json: no such file" in err


def test_a_row_with_paired_rounds_is_not_told_to_repeat():
    r = row("ddp", 1.5, rounds=[1.4, 1.5, 1.6])
    r.foreign_cpu = 0.6
    compare.flag([row("single", 1.0, "baseline", world=1), r])
    assert r.flags and all("--repeat" not in f for f in r.flags)


def _context_row(base: Row, layout: str, pairs: list[int], ms: list[float]) -> Row:
    d = {"context": {"cp": 4, "layout": layout, "comm": "ring", "causal_pairs_per_rank": pairs,
                     "attention_ms_per_rank": ms, "activation_bytes_per_rank": [2_275_000] * 4,
                     "single_activation_bytes_per_rank": [9_100_000] * 4},
         "bytes_per_step_by_collective": {"send": 2.36e6}}
    return dataclasses.replace(base, strategy="context_parallel", variant=f"cp_layout={layout}", world_size=4,
                               details=d, comm_bytes_per_step=4.89e6, comm_bytes_predicted=4.89e6)


def test_context_parallel_rows_get_their_table_and_picture_whole_in_100_columns(tmp_path):
    rows, env, skipped, _ = load()
    rows = rows[:2] + [_context_row(rows[1], "contiguous", [136, 392, 648, 904], [0.81, 1.3, 1.9, 2.5]),
                       _context_row(rows[1], "zigzag", [520] * 4, [9.0, 7.3, 6.8, 9.1])]
    text = render(100, rows, env, skipped)
    assert "…" not in text and max(map(len, text.splitlines())) <= 100
    table = text[text.index("Context parallel"):]
    for cell in ("zigzag ring", "136 392 648", "520 520 520", "4.66M (4.66M)", "2.17M (2.17M)"):
        assert cell in table, cell
    html = page.write(tmp_path / "report.html", rows, env, skipped).read_text()
    assert "Context parallel: each rank&#x27;s attention work" in html


def test_a_run_with_no_warm_up_says_what_its_first_step_added():
    # A shape on CPUs has no warm-up (a step of seconds): each row's median then includes its first step.
    a, b = dataclasses.replace(row("ddp", 1.0), step_ms=[1100.0, 1000.0]), dataclasses.replace(
        row("fsdp", 1.0), step_ms=[900.0, 1000.0, 1000.0])
    env = {"device_kind": "real", "run": {"warmup": 0}}
    line = "no warm-up: each step time includes the first step, which took 100% of a later one's time (median; " \
           "90-110% over 2 rows); --warmup 1 leaves it out"
    assert notes.first_steps([a, b]) == line and line in notes.notes([a, b], env)
    assert line not in notes.notes([a, b], {"device_kind": "real", "run": {"warmup": 1}})  # warm: nothing to say
    assert notes.first_steps([dataclasses.replace(a, step_ms=[1.0])]) is None  # one step: no later one


def test_a_row_is_saved_with_its_flags_so_a_stopped_run_keeps_them(tmp_path, monkeypatch):
    """Each row goes to results.json with its noise flag as it ends, not only at the end of the run: a run
    stopped by Ctrl-C after it keeps the flag (tests/data/h100_gpt2_small_results.json had none)."""
    from parallel import strategies
    from parallel.config import RunConfig

    def measured(s, variant, cfg, work, logs):
        r = row(s.name, 1.0, "match", world=1)
        r.foreign_cpu = 0.5  # other processes used half the machine while it ran
        return r, None

    monkeypatch.setattr(compare, "run_one", measured)
    config = RunConfig(devices="cpu:2", out=str(tmp_path)).validate()
    saved = []
    chosen = [(strategies.get(n), "", config) for n in ("single", "ddp")]
    compare.run_strategies(config, chosen, baseline=False, on_row=lambda rows: saved.append([r.flags for r in rows]))
    assert saved[0][0] and saved[0][0][0].startswith("noisy: other processes used 50%")
