"""DDP under torchrun: 2 gloo processes on loopback (torchrun --standalone picks a free port), each
launch with a timeout. Launches cost 5-8 s each here, so each one checks several things."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)


def compare(tmp_path, *args):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "parallel", "compare", "--strategies", "ddp", "--devices", "cpu:2",
                        "--steps", "5", "--warmup", "1", "--timeout", "120", "--out", str(out), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=200)
    rows = json.loads((out / "results.json").read_text())["rows"] if (out / "results.json").exists() else []
    return p, rows


@pytest.mark.slow
def test_ddp_with_and_without_accumulation_matches_single_counts_its_bytes_and_every_row_is_predicted(tmp_path):
    # 6 optimiser steps on the same global batch of 64: each rank takes 32, with --accum 2 as 2 micro-batches
    # of 16 (all-reduce on the second only). The verdict is the oracle's (2% of how far `single` moved each
    # tensor and each step's loss; see harness/equivalence.py), and the difference itself must be at
    # float-noise level, far below it. One comparison serves the cost model's checks too (a torchrun launch
    # costs 5-8 s here; the pipeline's and manual_dp's predictions: test_tensorboard.py, test_usermodel.py).
    p, rows = compare(tmp_path, "--workload", "mlp", "--batch-size", "64", "--accum", "1,2")
    assert p.returncode == 0, p.stdout + p.stderr
    assert [f"{r['strategy']} {r['variant']}".strip() for r in rows] == ["single", "ddp accum=1", "ddp accum=2"]
    single, ddp, accumulated = rows
    for r in (ddp, accumulated):
        assert r["status"] == "ok" and r["equivalence"]["verdict"] == "match", r["equivalence"]
        assert r["equivalence"]["ratio"] < 0.1 and r["equivalence"]["basis"] == "fp32 rule"
        assert r["world_size"] == 2 and r["launcher"] == "torchrun"
    assert ddp["final_loss"] == pytest.approx(single["final_loss"], abs=1e-5)  # all-reduced, not rank 0's
    # Bytes counted in the communication hook vs the textbook 2(N-1)/N x gradient bytes: within 1%.
    assert ddp["comm_bytes_per_step"] == pytest.approx(ddp["comm_bytes_predicted"], rel=0.01)
    assert ddp["comm_bytes_predicted"] == pytest.approx(3_684_362 * 4)  # N=2: exactly the gradient bytes
    details, measured = ddp["details"], ddp["measured"]
    assert details["no_sync_step_ms"] > 0 and measured["allreduce_all_grads_ms"] > 0
    assert measured["exposed_comm_ms"] == pytest.approx(details["step_ms"] - details["no_sync_step_ms"])
    # The cost model: every row predicted, calibrated in this run, and the NCCL projection labelled.
    assert all(r["step_ms_predicted"] and r["step_ms_predicted"] > 0 for r in rows), rows
    model = json.loads((tmp_path / "out" / "results.json").read_text())["cost_model"]
    assert model["alpha_us"] > 0 and model["beta_ns_per_byte"] >= 0 and model["copy_GB_per_s"] > 0
    assert set(model["projection"]["us_by_gpus"]) == {"8", "64", "1024"}
    assert "Projection, not measured" in (tmp_path / "out" / "details.txt").read_text()  # --wide's notes


@pytest.mark.slow
def test_torchrun_script_runs_and_writes_the_same_results(tmp_path):
    out = tmp_path / "script"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "scripts/ddp.py", "--steps", "3", "--batch-size", "32", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["strategy"] == "ddp" and row["world_size"] == 2 and row["devices"] == "cpu:2"
    assert p.stdout.count("Every strategy against") == 1  # only rank 0 prints the table


@pytest.mark.slow
def test_script_without_torchrun_is_a_world_of_one(tmp_path):
    p = subprocess.run([sys.executable, "scripts/ddp.py", "--steps", "2", "--batch-size", "16", "--devices", "cpu:1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "1 serial" in p.stdout  # one device: DDP's machinery runs, nothing in parallel


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--accum", "0"], "--accum must be at least 1, got 0"),
        (["--accum", "3"], "global batch 512 is not divisible by world size 2 x accum 3 = 6"),
        (["--bucket-mb", "-1"], "--bucket-mb must be 0 (torch's default) or more, got -1.0"),
        (["--prescale", "2"], "--prescale must be 0 or 1, got 2"),
        (["--accum", "two"], "invalid comma-separated int value: 'two'"),
    ],
)
def test_bad_ddp_options_are_one_line_exit_2(argv, message, refused):
    refused(["compare", "--strategies", "ddp", "--devices", "cpu:2", *argv], message)
