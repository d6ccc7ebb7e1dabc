"""The cost model: its all-reduce fit and its formulas (every row of a real comparison predicted: test_compare.py)."""


import time

import pytest

from parallel.config import RunConfig
from parallel.loop.timing import median_time
from parallel.report import costmodel


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


# Every row of a comparison predicted, end to end: test_compare.py's comparison checks it (a launch costs seconds).


@pytest.mark.parametrize("name, expected", [
    ("single", [3]), ("ddp_like_data_parallel", [3]), ("manual_dp", [4, 1]), ("hogwild", [3, 2]),
])
def test_model_state_per_device_counts_parameters_gradients_and_momentum(name, expected):
    from parallel import strategies
    from parallel.worker import execute
    from parallel.world.dist import Dist

    p = 32_998 * 4  # the CNN's parameters in bytes; SGD with momentum keeps one buffer per parameter
    strategy = "data_parallel" if name == "ddp_like_data_parallel" else name
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0).validate()
    row, _ = execute(strategies.get(strategy), config, Dist())
    assert row.details["model_state_bytes_per_device"] == [k * p for k in expected]


def test_model_state_of_stages_adds_up_to_the_whole_model():
    from parallel import strategies
    from parallel.worker import execute
    from parallel.world.dist import Dist

    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0).validate()
    row, _ = execute(strategies.get("pipeline"), config, Dist())
    per_stage = row.details["model_state_bytes_per_device"]
    assert len(per_stage) == 2 and sum(per_stage) == 3 * 32_998 * 4


def test_memory_projection_follows_the_zero_paper_and_says_from_how_many_gpus_each_stage_fits():
    from parallel.report.notes import memory_lines

    gib = 2**30
    small, large = costmodel.memory_projection(7e9), costmodel.memory_projection(70e9)
    # 16 bytes a parameter unsharded (fp16 parameter and gradient, 12 of Adam in fp32): 104 GiB at 7e9.
    assert small["GiB_by_stage"]["DDP (no sharding)"][1024] == pytest.approx(16 * 7e9 / gib)
    assert small["GiB_by_stage"]["ZeRO-1 (zero)"][8] == pytest.approx((4 * 7e9 + 12 * 7e9 / 8) / gib)
    assert small["GiB_by_stage"]["ZeRO-2 (zero --zero-stage 2)"][64] == pytest.approx((2 * 7e9 + 14 * 7e9 / 64) / gib)
    assert large["GiB_by_stage"]["ZeRO-3 (FSDP)"][64] == pytest.approx(16 * 70e9 / 64 / gib)
    # 7e9 fits 80 GiB from 2 GPUs once anything is sharded; at 70e9 the unsharded 2 or 4 bytes of ZeRO-1/2
    # alone exceed it, and ZeRO-3 needs 1120 GB / 85.9 GB = 13.04 -> 16 GPUs.
    assert small["fits_from_gpus"] == {"DDP (no sharding)": None, "ZeRO-1 (zero)": 2,
                                       "ZeRO-2 (zero --zero-stage 2)": 2, "ZeRO-3 (FSDP)": 2}
    assert large["fits_from_gpus"] == {"DDP (no sharding)": None, "ZeRO-1 (zero)": None,
                                       "ZeRO-2 (zero --zero-stage 2)": None, "ZeRO-3 (FSDP)": 16}
    lines = memory_lines({"memory_projection": large})
    assert "70 GiB" not in lines[0] and "7e+10 parameters" in lines[0]
    assert any("ZeRO-3 (FSDP): 8 GPUs 130.4 GiB" in ln and "fits from 16 GPUs" in ln for ln in lines), lines
    assert any("ZeRO-1 (zero)" in ln and "never fits" in ln for ln in lines)


def test_the_calibration_times_fewer_runs_of_a_long_step_but_at_least_three():
    # At GPT-2's vocabulary a CPU step takes seconds: 7 timed runs (and a warm-up) of it were 21 s of a
    # 78 s comparison of one row (#44). With a budget the runs stop at what fits, and never below 3, unless
    # the warm-up alone took longer than the whole budget: then its time is the answer (a run of seconds is
    # warm from the first: within 2% at GPT-2 small's shape).
    calls = []

    def step(seconds):
        calls.append(seconds)
        time.sleep(seconds)

    assert median_time(lambda: step(0.04), 7, lambda: None, budget_s=0.1) >= 0.04 and len(calls) == 1 + 3
    calls.clear()
    median_time(lambda: step(0.0), 7, lambda: None, budget_s=0.1)  # a short step: every run
    assert len(calls) == 1 + 7
    calls.clear()
    assert median_time(lambda: step(0.12), 7, lambda: None, budget_s=0.1) >= 0.12  # over the budget: the warm-up
    assert len(calls) == 1


def test_a_step_of_seconds_is_scaled_to_another_batch_not_timed_again():
    # At GPT-2 small's shape on this CPU `single`'s step is 9 s: timing it again at half the batch cost 10 s
    # of the parent's time for what the proportion says (4.75 s timed, 4.6 s scaled). A short step is timed.
    cal = costmodel.Calibration.__new__(costmodel.Calibration)
    cal._compute, cal.scaled = {8: 9_000.0}, set()
    assert cal.compute_ms(4) == 4_500.0 and cal.compute_ms(2) == 2_250.0  # from the measured 8, not the scaled 4
    assert cal.measured() == {8: 9_000.0} and cal.scaled == {2, 4}
    cal._compute, cal.scaled = {8: 900.0}, set()
    assert cal._scaled(4) is None  # under the budget: timed, since small steps are not in proportion
