"""The loop, the clocks, the workloads and the `single` baseline, all in this process."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from parallel import strategies
from parallel.loop.timing import StepTimer, summarize
from parallel.loop.train import NonFiniteLoss, step_lines, train
from parallel.models.data import SyntheticData
from parallel.models.nets import MLP
from parallel.models.workloads import WORKLOADS
from parallel.worker import execute
from parallel.world.dims import ParallelDims
from parallel.world.dist import Dist

REPLICAS = lambda config, dist: ParallelDims.data_parallel(dist.world_size)  # noqa: E731 - what the loop asks a strategy


def test_timer_synchronizes_before_every_clock_read():
    events = []
    clock = iter([10.0, 10.5])
    timer = StepTimer(lambda: events.append("sync"), clock=lambda: events.append("clock") or next(clock))
    with timer:
        events.append("work")
    assert events == ["sync", "clock", "work", "sync", "clock"]
    assert timer.elapsed == 0.5


def test_summary_is_median_and_p95():
    s = summarize([0.001] * 19 + [1.0])
    assert s["p50_ms"] == pytest.approx(1.0) and s["p95_ms"] > 1.0 and s["n"] == 20
    assert summarize([])["p50_ms"] is None


def test_warmup_steps_are_trained_but_not_timed(small, monkeypatch):
    """A fake step that takes 100 s during warm-up and 1 s after, on a clock of its own (a wall clock on a
    busy machine gave a 10 ms step 0.2 s): the timed steps must not see the warm-up."""
    config = small(warmup=2, steps=3)
    calls, now = [], [0.0]

    def train_step(trainable, batch, dist):
        now[0] += 100.0 if len(calls) < config.warmup else 1.0
        calls.append(batch[0].shape[0])
        return torch.tensor(1.0)

    import parallel.loop.train

    monkeypatch.setattr(parallel.loop.train, "StepTimer", lambda sync: StepTimer(sync, clock=lambda: now[0]))
    fake = SimpleNamespace(name="fake", train_step=train_step, dims=REPLICAS)
    data = SyntheticData(WORKLOADS["cnn"], 0, config.batch_size)
    result = train(fake, None, data, config, Dist())
    assert len(calls) == 5 and len(result.losses) == 5
    assert result.step_s == [1.0, 1.0, 1.0]  # none of the warm-up steps


def test_non_finite_loss_names_the_step(small):
    fake = SimpleNamespace(name="fake", train_step=lambda t, b, d: torch.tensor(float("nan")), dims=REPLICAS)
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 0 of fake"):
        train(fake, None, SyntheticData(WORKLOADS["cnn"], 0, 32), small(), Dist())


def test_same_seed_same_weights_and_batches():
    for w in WORKLOADS.values():
        a, b = w.build_model(3).state_dict(), w.build_model(3).state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)
        c = w.build_model(4).state_dict()
        assert not all(torch.equal(a[k], c[k]) for k in a)
    d1, d2 = SyntheticData(WORKLOADS["mlp"], 0, 64), SyntheticData(WORKLOADS["mlp"], 0, 64)
    assert torch.equal(d1.batch(5)[0], d2.batch(5)[0]) and torch.equal(d1.batch(5)[1], d2.batch(5)[1])


def test_rank_shares_make_up_the_global_batch():
    data = SyntheticData(WORKLOADS["cnn"], 0, 96)
    x, y = data.batch(7)
    shares = [data.batch(7, r, 4) for r in range(4)]
    assert torch.equal(torch.cat([s[0] for s in shares]), x) and torch.equal(torch.cat([s[1] for s in shares]), y)
    assert len(set(y.tolist())) > 5  # the teacher uses many classes


def test_workload_shapes():
    assert sum(p.numel() for p in MLP().parameters()) == 3_684_362  # 512*1024 + 3*1024^2 + 1024*10 + biases
    assert WORKLOADS["cnn"].build_model(0)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_single_is_bitwise_reproducible(small):
    single = strategies.get("single")
    _, a = execute(single, small(workload="mlp"), Dist())
    _, b = execute(single, small(workload="mlp"), Dist())
    assert a.keys() == WORKLOADS["mlp"].build_model(0).state_dict().keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_loss_genuinely_falls(small):
    for workload in ("mlp", "cnn"):  # the classifiers, from ln 10; the others' are in test_workloads.py
        row, _ = execute(strategies.get("single"), small(workload=workload, batch_size=128, steps=40), Dist())
        assert row.losses[0] > 2.25 and row.final_loss < row.losses[0] - 0.15, (workload, row.losses)


def test_the_loop_synchronizes_every_device_a_process_drives(small, monkeypatch):
    """A multi-device strategy's last work may run on device 1 (a pipeline's last stage): both clocks of
    every step must wait for every device the Trainable names, not only the rank's own."""
    from parallel.strategies.base import Trainable

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    t = Trainable(None, None, None, devices[0], devices=devices)
    fake = SimpleNamespace(name="fake", train_step=lambda tr, b, d: torch.tensor(1.0), dims=REPLICAS)
    train(fake, t, SyntheticData(WORKLOADS["cnn"], 0, 32), small(warmup=0, steps=2), Dist())
    assert calls == devices * 4  # before and after each of the 2 steps


# ---- the per-step log lines (OUT/logs/<strategy>.log), from what the loop recorded


def test_step_lines_one_per_step_warmup_marked():
    lines = step_lines([2.3, 2.2, 2.1, 2.0], [30.0, 40.0], warmup=2, steps=2)
    assert lines == ["warmup 1/2  loss 2.3000", "warmup 2/2  loss 2.2000",
                     "step 1/2  loss 2.1000  ms 30.0", "step 2/2  loss 2.0000  ms 40.0"]
    # resumed after 3 steps: only the last ones ran; several losses a step (the DCGAN's) each by name
    assert step_lines([2.1, 2.0], [30.0, 40.0], warmup=1, steps=3, loss_parts={"d": [1.0, 0.9], "g": [0.5, 0.4]}) \
        == ["step 2/3  loss 2.1000  d 1.0000  g 0.5000  ms 30.0", "step 3/3  loss 2.0000  d 0.9000  g 0.4000  ms 40.0"]
    # Hogwild: its two workers' timed steps one after the other, shown as their mean a step
    assert step_lines([2.0, 1.9], [10.0, 20.0, 30.0, 40.0], warmup=0, steps=2)[1] == "step 2/2  loss 1.9000  ms 30.0"


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # @record's, under capsys (no fileno)
def test_the_worker_logs_a_line_a_step_and_names_the_run(small, tmp_path, capsys):
    """What OUT/logs/<strategy>.log holds: the harness's child is this worker, its stdout the log file."""
    from parallel import worker

    config = small(warmup=2, steps=3)
    (tmp_path / "cfg.json").write_text(config.to_json())
    argv = ["--strategy", "manual_dp", "--config", str(tmp_path / "cfg.json"), "--result", str(tmp_path / "r.json"),
            "--state", str(tmp_path / "p.pt")]
    assert worker.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("run manual_dp: world size 2 (inprocess) on cpu:2") and "global batch 32" in lines[0]
    steps = [ln for ln in lines if re.fullmatch(r"(warmup \d/2|step \d/3)  loss \d+\.\d{4}(  ms \d+\.\d)?", ln)]
    assert [ln.split("  ")[0] for ln in steps] == ["warmup 1/2", "warmup 2/2", "step 1/3", "step 2/3", "step 3/3"]
    assert all(" ms " in ln for ln in steps[2:]) and not any(" ms " in ln for ln in steps[:2])
    row = json.loads((tmp_path / "r.json").read_text())
    assert [float(ln.split()[3]) for ln in steps] == pytest.approx(row["losses"], abs=1e-4)
    assert lines[-1] == f"done manual_dp: final loss {row['final_loss']:.4f}  p50 ms {row['step_ms_p50']:.1f}  " \
                        f"p95 ms {row['step_ms_p95']:.1f}  samples/s {row['samples_per_s']:,.0f}"
    assert len(lines) == 1 + 5 + 1


@pytest.mark.slow
def test_torchrun_logs_its_steps_once_from_rank_0(small, tmp_path):
    from parallel.compare import run_one

    logs = tmp_path / "logs"
    logs.mkdir()
    row, _ = run_one(strategies.get("ddp"), "", small(warmup=1, steps=3, out=str(tmp_path)), tmp_path, logs)
    assert row.status == "ok", row.error
    log = (logs / "ddp.log").read_text().splitlines()
    assert sum(ln.startswith("run ddp: world size 2 (torchrun, gloo)") for ln in log) == 1
    assert [ln.split("  ")[0] for ln in log if re.match(r"(warmup|step) \d", ln)] == \
        ["warmup 1/1", "step 1/3", "step 2/3", "step 3/3"]
    assert log[-1].startswith("done ddp: final loss ")
