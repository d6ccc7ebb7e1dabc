"""`python -m parallel preflight` on this machine: every strategy, the GPU basics and a torchrun restart
pass on the CPU, and the CUDA checks are listed as not run, each with its reason."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from parallel import cli
from tests.conftest import ROOT


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_preflight_passes_here_and_lists_what_needs_a_gpu(tmp_path, capsys):
    # `single` alone, to keep the suite short (every launch has its own module's tests; a torchrun group
    # runs here in the restart check); `./launch.sh preflight` runs them all. On three devices, which
    # refused the whole preflight before (a batch of 64 does not divide by 3): now 63 (#28; the pipelines'
    # micro-batches fitted to it: tests/test_planning.py).
    names = ["single"]
    assert cli.main(["preflight", "--devices", "cpu:3", "--strategies", ",".join(names), "--out", str(tmp_path)]) == 0
    checks = json.loads((tmp_path / "preflight.json").read_text())["checks"]
    by_status = {s: [c["name"] for c in checks if c["status"] == s] for s in ("passed", "failed", "not run")}
    assert by_status["failed"] == []
    assert {f"{n} on cpu:3" for n in names} <= set(by_status["passed"])
    assert {"torchrun restart after a failed rank", "bench cpu-vs-gpu", "bench memory", "devices"} <= \
        set(by_status["passed"])
    assert "bench streams" in by_status["not run"] and "strategies on GPUs (nccl)" in by_status["not run"]
    assert all(c["detail"] for c in checks if c["status"] == "not run")  # each says why
    out = capsys.readouterr().out
    assert all(c["name"] in out for c in checks)  # one line per check on the terminal


def test_preflight_refuses_bad_input(refused):
    refused(["preflight", "--devices", "cpu:0"], "the virtual device count must be 1..64, got 0")
    refused(["preflight", "--workload", "nosuch"], "unknown workload 'nosuch'")
    refused(["preflight", "--strategies", "nosuch"], "unknown strategy 'nosuch'")


def test_a_stopped_preflight_prints_one_line_and_keeps_its_finished_checks(tmp_path, monkeypatch, capsys,
                                                                          signals_restored):
    # SIGTERM (a scheduler, `timeout`) is turned into Ctrl-C's KeyboardInterrupt (cli._interrupt); before, a
    # stopped preflight printed a 20-line traceback and kept nothing (H100, 2026-11-25)
    from parallel import preflight
    from parallel.loop.results import Equivalence, Row

    def stopped_after_one_row(config, chosen, on_row):
        row = Row("single", "", "inprocess", config.devices, "serial", 1, config.batch_size)
        row.equivalence = Equivalence("baseline", 0.0)
        on_row([row])
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM did not interrupt")

    monkeypatch.setattr(preflight, "run_strategies", stopped_after_one_row)
    code = cli.main(["preflight", "--devices", "cpu:1", "--strategies", "single", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "preflight.json").read_text())
    assert code == 130 and saved["stopped"] and [c["status"] for c in saved["checks"]] == ["passed"]
    out = capsys.readouterr().out
    assert "interrupted: 1 finished checks" in out and "Traceback" not in out


def test_a_comparison_stopped_after_its_rows_prints_one_line(tmp_path, monkeypatch, capsys, signals_restored):
    # Stopped in the cost model's timing, after every row was saved: the traceback an H100 run printed
    from parallel.loop.results import Equivalence, Row
    from parallel.report import costmodel

    def finished(config, chosen, baseline, on_row):  # `single`'s row, as a child would have written it
        row = Row("single", "", "inprocess", config.devices, "virtual", 1, config.batch_size, step_ms_p50=1.0)
        row.equivalence = Equivalence("baseline", 0.0)
        on_row([row])
        return [row]

    def stopped(*_):
        raise KeyboardInterrupt("signal 15")

    monkeypatch.setattr(cli, "run_strategies", finished)
    monkeypatch.setattr(costmodel, "apply", stopped)
    code = cli.main(["compare", "--strategies", "single", "--devices", "cpu:1", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 130 and err.strip().splitlines()[-1] == "interrupted" and "Traceback" not in err
    assert (tmp_path / "results.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sigterm_ends_a_real_preflight_and_every_child_it_started(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "parallel", "preflight", "--devices", "cpu:2", "--strategies",
                             "single,ddp", "--out", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "logs").exists() or not any((tmp_path / "logs").iterdir()):  # a check under way
        assert time.monotonic() < deadline and proc.poll() is None, "preflight started no check"
        time.sleep(0.2)
    time.sleep(0.5)  # inside its first check (the first seconds: the zygote may still be importing torch)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in out, out[-2000:]
    assert out.strip().splitlines()[-1].startswith("interrupted: ")  # one line, however long its path
    assert json.loads((tmp_path / "preflight.json").read_text())["stopped"]
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], f"processes left in the preflight's session: {left}"
