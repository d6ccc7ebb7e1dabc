"""The profiler traces and scalars open in a real TensorBoard with torch-tb-profiler, one run per strategy."""

import csv
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import ROOT
from tests.test_cli import ROW_FIELDS, assert_one_timeline

pytestmark = pytest.mark.timeout(180)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_tensorboard_lists_every_profiled_strategy_and_rank_traces_do_not_collide(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "parallel", "compare", "--strategies", "ddp,pipeline", "--profile",
                        "--devices", "cpu:2", "--steps", "5", "--batch-size", "64", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert p.returncode == 0, p.stdout + p.stderr
    # What compare writes (one run serves these checks too: a compare costs 10-30 s here)
    assert "baseline" in p.stdout and "simulated: cpu:2" in p.stdout and "Pipelines: idle and step" in p.stdout
    doc = json.loads((out / "results.json").read_text())
    assert set(doc) == {"config", "environment", "rows", "skipped", "cost_model"} and doc["skipped"] == {}
    assert {"torch", "devices", "threads_per_device", "hostname", "time", "run"} <= set(doc["environment"])
    single = doc["rows"][0]
    assert all(set(r) == ROW_FIELDS for r in doc["rows"])
    assert all(r["step_ms_predicted"] > 0 for r in doc["rows"])  # the cost model predicts every row
    assert single["strategy"] == "single" and single["status"] == "ok" and single["device_kind"] == "virtual"
    assert single["speedup"] == 1.0 and single["equivalence"]["verdict"] == "baseline"
    assert single["step_ms_p50"] > 0 and len(single["step_ms"]) == 5 and len(single["losses"]) == 8
    with open(out / "results.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == ["single", "ddp", "pipeline"]
    assert "<svg" in (out / "report.html").read_text() and "ddp (torchrun" in (out / "details.txt").read_text()
    assert not list(out.glob(".results.*"))  # no temporary files left behind
    traces = sorted(f.name.split(".")[0] for f in (out / "tb" / "ddp").glob("*.pt.trace.json"))
    assert traces == ["ddp_rank0", "ddp_rank1"]  # one file per rank, named by rank: nothing overwritten
    # The same run's merged timeline: a track per rank, and per device thread of the in-process pipeline,
    # with the phase labels (one compare serves both checks: each costs 10-30 s here).
    doc = assert_one_timeline(out / "timeline.json", {"single rank 0", "ddp rank 0", "ddp rank 1", "pipeline rank 0"})
    threads = {e["args"]["name"] for e in doc["events"] if e.get("name") == "thread_name"}
    assert {"device cpu:0", "device cpu:1"} <= {t.split("(")[-1].rstrip(")") for t in threads}
    labels = {e["name"] for e in doc["events"] if e.get("ph") == "X"}
    assert {"step 2", "stage 0 F0", "stage 1 B0"} <= labels

    port = _free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out / "tb"), "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs, deadline = [], time.monotonic() + 90
        while time.monotonic() < deadline and set(runs) != {"single", "ddp", "pipeline"}:
            time.sleep(1)
            try:
                runs = _get(f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs")["runs"]
            except OSError:
                continue
        assert set(runs) == {"single", "ddp", "pipeline"}, runs
        tags = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
        assert all({"loss/train", "step_time_ms"} <= set(tags[run]) for run in ("single", "ddp", "pipeline")), tags
    finally:
        tb.terminate()
        tb.wait(timeout=10)
