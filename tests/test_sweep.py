"""`python -m parallel sweep`: the grid, one TensorBoard run per point (scalars and hparams), the table."""

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from parallel import cli, sweep
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS

pytestmark = pytest.mark.timeout(180)


@pytest.mark.slow
def test_sweep_writes_one_tensorboard_run_per_grid_point(tmp_path, capsys):
    out = tmp_path / "sweep"
    code = cli.main(["sweep", "--lr", "0.05,0.01", "--batch-size", "64", "--num-workers", "0,1", "--device", "cpu,cuda",
                     "--steps", "3", "--warmup", "1", "--out", str(out)])
    assert code == 0
    doc = json.loads((out / "sweep.json").read_text())
    cpu_points = {(r["lr"], r["num_workers"]) for r in doc["runs"]}
    assert cpu_points == {(0.05, 0), (0.05, 1), (0.01, 0), (0.01, 1)}
    assert all(r["status"] == "ok" and len(r["losses"]) == 4 for r in doc["runs"])
    runs = sorted(p for p in (out / "tb").iterdir())
    assert len(runs) == 4 + (4 if torch.cuda.is_available() else 0)
    for run in runs:
        ea = EventAccumulator(str(run))
        ea.Reload()
        assert "loss/train" in ea.Tags()["scalars"] and len(ea.Scalars("loss/train")) == 4
        assert "_hparams_/session_start_info" in ea.PluginTagToContent("hparams")  # the HPARAMS tab's record
    if not torch.cuda.is_available():
        assert "cuda: 4 run(s) skipped, no CUDA device here" in capsys.readouterr().out
    # Same lr, same data, same seed: the loader processes change how batches arrive, not what they are.
    by = {(r["lr"], r["num_workers"]): r["losses"] for r in doc["runs"]}
    assert by[(0.05, 0)] == pytest.approx(by[(0.05, 1)], abs=1e-6)
    assert (out / "sweep.csv").read_text().count("\n") == 5


@pytest.mark.parametrize("workload, workers", [("cnn", 0), ("transformer", 1)])  # held samples; drawn per step
def test_the_loader_serves_the_same_batches_as_every_other_command(workload, workers):
    data = SyntheticData(WORKLOADS[workload], 0, 32)
    loader = sweep.LoaderData(data, steps=3, num_workers=workers, pin_memory=False, timeout=10)
    for step in range(3):
        for a, b in zip(loader.batch(step), data.batch(step), strict=True):
            assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="in order"):
        loader.batch(0)
    loader.close()


@pytest.mark.parametrize("argv, message", [
    (["sweep", "--lr", "0.1,x"], "--lr '0.1,x': expected a comma list of float"),
    (["sweep", "--num-workers", "-1"], "--num-workers must be 0 or more"),
    (["sweep", "--device", "tpu"], "expected cpu, cuda or cuda:N"),
    (["sweep", "--lr", "-0.1"], "--lr must be a positive finite number"),
    (["sweep", "--workload", "dcgan"], "one optimiser; dcgan has several"),
])
def test_sweep_refuses_bad_input(argv, message, refused):
    refused(argv, message)


def test_a_sweep_with_nothing_to_run_is_refused_and_writes_nothing(monkeypatch, refused):
    monkeypatch.setattr(sweep, "gpu_count", lambda: 0)  # every point on cuda: none can run here
    refused(["sweep", "--device", "cuda", "--lr", "0.1,0.2"],
            "error: the sweep has nothing to run: cuda: 2 run(s) skipped, no CUDA device here")


def _run(step_ms: list[float], lr=0.1, **kw) -> dict:
    ms = sorted(step_ms)
    return {"lr": lr, "batch_size": 64, "num_workers": 0, "device": "cpu", "status": "ok", "step_ms": step_ms,
            "step_ms_p50": ms[len(ms) // 2], "step_ms_end_to_end": ms[len(ms) // 2] * 1.05, "others_cpu": 0.0, **kw}


def test_sweep_timings_that_cannot_be_right_are_flagged_in_the_table():
    quiet = _run([10.0, 10.2, 10.1, 10.3, 9.9])
    same_work_slower = _run([30.0, 31.0, 29.0, 30.5, 30.2], lr=0.2)  # only lr differs: the same step, 3x the time
    busy = _run([10.0, 10.1, 10.2], others_cpu=0.4, batch_size=128)
    scattered = _run([5.0, 12.0, 13.0, 14.0, 15.0], batch_size=256)  # median 2.6x its fastest repeat
    short = _run([10.0, 10.0, 10.0], batch_size=512, step_ms_end_to_end=6.0)  # step+load shorter than the step
    failed = {"lr": 0.1, "batch_size": 64, "num_workers": 0, "device": "cuda", "status": "failed", "error": "x"}
    results = [quiet, same_work_slower, busy, scattered, short, failed]
    sweep.flag_timings(results)
    assert "run #1" in same_work_slower["noisy"] and "run #2" in quiet["noisy"]  # which is wrong: unknown
    assert "40% of the machine's CPU" in busy["noisy"]
    assert "2.6x its fastest repeat" in scattered["noisy"]
    assert "step+load 6 ms is less than the step alone" in short["noisy"]
    assert failed["noisy"] == ""
    fine = [_run([10.0, 10.2, 10.1]), _run([10.5, 10.4, 10.6], lr=0.2)]
    sweep.flag_timings(fine)
    assert [r["noisy"] for r in fine] == ["", ""]

    from rich.console import Console

    console = Console(width=300, record=True, color_system=None)
    console.print(sweep.table(results, "t"))
    rows = [line for line in console.export_text().splitlines() if "│ cpu" in line]
    assert len(rows) == 5 and all("noisy" in line for line in rows)
