"""The cost model: its all-reduce fit, its formulas, and predictions on every row of a real comparison."""

import json
import subprocess
import sys

import pytest

from parallel.config import RunConfig
from parallel.harness import costmodel
from tests.conftest import ROOT


def test_alpha_beta_fit_inverts_the_ring_formula():
    alpha, beta = 100e-6, 2e-9  # 100 us, 2 ns per byte
    n, big = 4, 8e6
    small_ms = 2 * (n - 1) * alpha * 1e3  # a 4-byte all-reduce is latency only
    large_ms = (2 * (n - 1) * alpha + 2 * (n - 1) / n * big * beta) * 1e3
    a, b = costmodel.fit_alpha_beta(small_ms, large_ms, big, n)
    assert a == pytest.approx(alpha) and b == pytest.approx(beta)
    cal = costmodel.Calibration(RunConfig(devices="cpu:2").validate(), a, b)
    assert cal.allreduce_ms(big, n) == pytest.approx(large_ms)
    assert cal.allreduce_ms(big, 1) == 0.0


def test_projection_follows_the_bus_bandwidth_formula():
    cal = costmodel.Calibration(RunConfig(workload="mlp", devices="cpu:2").validate())
    us = cal.projection()
    assert us[8] == pytest.approx(3_684_362 * 4 * 2 * 7 / 8 / 346e9 * 1e6)
    assert us[8] < us[64] < us[1024] < 2 * us[8]  # 2(N-1)/N approaches 2


@pytest.mark.slow
def test_every_row_of_a_comparison_gets_a_prediction(tmp_path):
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "parallel", "compare", "--strategies", "manual_dp,ddp,pipeline",
                        "--devices", "cpu:2", "--steps", "4", "--batch-size", "128", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((out / "results.json").read_text())
    assert all(r["step_ms_predicted"] and r["step_ms_predicted"] > 0 for r in doc["rows"]), doc["rows"]
    model = doc["cost_model"]
    assert model["alpha_us"] > 0 and model["beta_ns_per_byte"] >= 0 and model["copy_GB_per_s"] > 0
    assert set(model["projection"]["us_by_gpus"]) == {"8", "64", "1024"}
    assert "Projection, not measured" in p.stdout


@pytest.mark.parametrize("name, expected", [
    ("single", [3]), ("ddp_like_data_parallel", [3]), ("manual_dp", [4, 1]), ("hogwild", [3, 2]),
])
def test_model_state_per_device_counts_parameters_gradients_and_momentum(name, expected):
    from parallel import strategies
    from parallel.dist import Dist
    from parallel.worker import execute

    p = 32_998 * 4  # the CNN's parameters in bytes; SGD with momentum keeps one buffer per parameter
    strategy = "data_parallel" if name == "ddp_like_data_parallel" else name
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0).validate()
    row, _ = execute(strategies.get(strategy), config, Dist())
    assert row.details["model_state_bytes_per_device"] == [k * p for k in expected]


def test_model_state_of_stages_adds_up_to_the_whole_model():
    from parallel import strategies
    from parallel.dist import Dist
    from parallel.worker import execute

    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0).validate()
    row, _ = execute(strategies.get("pipeline"), config, Dist())
    per_stage = row.details["model_state_bytes_per_device"]
    assert len(per_stage) == 2 and sum(per_stage) == 3 * 32_998 * 4
