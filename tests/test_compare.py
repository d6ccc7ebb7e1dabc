"""One `python -m parallel compare` as a user types it (in this process: conftest.in_process), read by every
check of what a comparison writes: the rows and the oracle's verdicts, DDP with and without gradient
accumulation, Hogwild judged by where it converged, the cost model, results.json/.csv, report.html, the
per-rank profiler traces, the merged timeline, and TensorBoard serving them. A comparison costs 10-30 s here
(a child process per strategy, a torchrun group per SPMD one), so one run serves them all (the suite's time:
tests/README or docs/measurements.md).

The run is in float64 (--precision fp64): there a split batch can differ from one device by rounding only,
far below the oracle's fp64 rule, on any machine (docs/oracle.md); fp32 comparisons are run by the other
end-to-end tests."""

import csv
import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import in_process
from tests.multirank import FP64_MARGIN
from tests.test_cli import ROW_FIELDS, assert_one_timeline

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
PSI = 3_684_362  # the MLP's parameters
E = 8  # bytes per element (fp64)
NAMES = ["single", "ddp accum=1", "ddp accum=2", "pipeline", "hogwild"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """4 optimiser steps (1 warm-up) on a global batch of 64 of the MLP, 2 virtual CPU devices: each DDP rank
    takes 32, with --accum 2 as 2 micro-batches of 16 (all-reduce on the second only); the pipeline's 2
    stages; Hogwild's 2 workers. Every strategy profiled."""
    out = tmp_path_factory.mktemp("compare") / "run"
    p = in_process("compare", "--strategies", "ddp,pipeline,hogwild", "--accum", "1,2", "--profile", "--workload",
                   "mlp", "--devices", "cpu:2", "--steps", "3", "--warmup", "1", "--batch-size", "64", "--precision",
                   "fp64", "--timeout", "150", "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "results.json").read_text())
    return p.stdout, out, doc, {f"{r['strategy']} {r['variant']}".strip(): r for r in doc["rows"]}


def test_every_row_is_written_judged_predicted_and_profiled(run):
    stdout, out, doc, rows = run
    assert list(rows) == NAMES
    assert "baseline" in stdout and "simulated: cpu:2" in stdout and "Pipelines: idle and step" in stdout
    assert set(doc) == {"config", "environment", "rows", "skipped", "cost_model"} and doc["skipped"] == {}
    assert {"torch", "devices", "threads_per_device", "hostname", "time", "run"} <= set(doc["environment"])
    assert all(set(r) == ROW_FIELDS and r["status"] == "ok" for r in doc["rows"])
    assert all(r["step_ms_predicted"] and r["step_ms_predicted"] > 0 for r in doc["rows"])  # the cost model
    single = rows["single"]
    assert single["device_kind"] == "virtual" and single["speedup"] == 1.0
    assert single["equivalence"]["verdict"] == "baseline"
    assert single["step_ms_p50"] > 0 and len(single["step_ms"]) == 3 and len(single["losses"]) == 4
    with open(out / "results.csv") as f:
        assert [r["strategy"] for r in csv.DictReader(f)] == [n.split()[0] for n in NAMES]
    assert "<svg" in (out / "report.html").read_text() and "ddp accum=2 (torchrun" in (out / "details.txt").read_text()
    assert not list(out.glob(".results.*"))  # no temporary files left behind
    model = doc["cost_model"]  # calibrated in this run, and the NCCL projection labelled
    assert model["alpha_us"] > 0 and model["beta_ns_per_byte"] >= 0 and model["copy_GB_per_s"] > 0
    assert set(model["projection"]["us_by_gpus"]) == {"8", "64", "1024"}
    assert "Projection, not measured" in (out / "details.txt").read_text()  # --wide's notes


def test_ddp_with_and_without_accumulation_matches_single_and_counts_its_bytes(run):
    rows = run[3]
    for r in (rows["ddp accum=1"], rows["ddp accum=2"], rows["pipeline"]):
        assert r["equivalence"]["verdict"] == "match" and r["equivalence"]["ratio"] < FP64_MARGIN, r["equivalence"]
        assert r["equivalence"]["basis"].startswith("fp64 rule") and r["world_size"] == 2
    ddp = rows["ddp accum=1"]
    assert ddp["launcher"] == "torchrun"
    assert ddp["final_loss"] == pytest.approx(rows["single"]["final_loss"], abs=1e-9)  # all-reduced, not rank 0's
    # Bytes counted in the communication hook vs the textbook 2(N-1)/N x gradient bytes: within 1%.
    assert ddp["comm_bytes_per_step"] == pytest.approx(ddp["comm_bytes_predicted"], rel=0.01)
    assert ddp["comm_bytes_predicted"] == pytest.approx(PSI * E)  # N=2: exactly the gradient bytes
    timed, measured = ddp["details"]["sharded"], ddp["measured"]
    assert timed["no_sync_step_ms"] > 0 and measured["allreduce_all_grads_ms"] > 0
    assert measured["exposed_comm_ms"] == pytest.approx(timed["step_ms"] - timed["no_sync_step_ms"])


def test_hogwild_is_judged_by_where_it_converged_not_by_parity(run):
    eq = run[3]["hogwild"]["equivalence"]
    assert eq["verdict"] == "not-expected" and "converged instead: eval loss" in eq["reason"]


def test_each_rank_writes_its_own_trace_and_one_timeline_holds_them_all(run):
    out = run[1]
    for variant in ("ddp_accum-1", "ddp_accum-2"):  # a variant's traces in its own run, beside its scalars
        traces = sorted(f.name.split(".")[0] for f in (out / "tb" / variant).glob("*.pt.trace.json"))
        assert traces == [f"{variant}_rank0", f"{variant}_rank1"]  # one file per rank: nothing overwritten
    # A track per rank (and per Hogwild worker), and per device thread of the in-process pipeline.
    doc = assert_one_timeline(out / "timeline.json", {"single rank 0", "ddp_accum-1 rank 0", "ddp_accum-1 rank 1",
                                                      "ddp_accum-2 rank 0", "ddp_accum-2 rank 1", "pipeline rank 0",
                                                      "hogwild rank 0", "hogwild rank 1"})
    threads = {e["args"]["name"] for e in doc["events"] if e.get("name") == "thread_name"}
    assert {"device cpu:0", "device cpu:1"} <= {t.split("(")[-1].rstrip(")") for t in threads}
    labels = {e["name"] for e in doc["events"] if e.get("ph") == "X"}
    assert {"step 2", "stage 0 F0", "stage 1 B0"} <= labels


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


def test_tensorboard_lists_every_profiled_strategy_with_its_scalars(run):
    out = run[1]
    expected = {p.name for p in (out / "tb").iterdir() if p.is_dir()}
    assert expected == {"single", "ddp_accum-1", "ddp_accum-2", "pipeline", "hogwild"}  # results.tb_run
    port = _free_port()
    tb = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(out / "tb"), "--host", "127.0.0.1",
                           "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        runs, deadline = [], time.monotonic() + 90
        while time.monotonic() < deadline and set(runs) != expected:
            time.sleep(1)
            try:
                runs = _get(f"http://127.0.0.1:{port}/data/plugin/pytorch_profiler/runs")["runs"]
            except OSError:
                continue
        assert set(runs) == expected, runs
        tags = _get(f"http://127.0.0.1:{port}/data/plugin/scalars/tags")
        assert all({"loss/train", "step_time_ms"} <= set(tags[run]) for run in expected), tags
    finally:
        tb.terminate()
        tb.wait(timeout=10)
