"""The loop, the clocks, the workloads and the `single` baseline, all in this process."""

import time
from types import SimpleNamespace

import pytest
import torch

from parallel import strategies
from parallel.dist import Dist
from parallel.layout import ParallelDims
from parallel.timing import StepTimer, summarize
from parallel.train import NonFiniteLoss, train
from parallel.worker import execute
from parallel.workloads import MLP, WORKLOADS, SyntheticData

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


def test_warmup_steps_are_trained_but_not_timed(small):
    """A fake step that is slow only during warm-up: the timed steps must not see the slowness."""
    config = small(warmup=2, steps=3)
    calls = []

    def train_step(trainable, batch, dist):
        time.sleep(0.3 if len(calls) < config.warmup else 0.01)
        calls.append(batch[0].shape[0])
        return torch.tensor(1.0)

    fake = SimpleNamespace(name="fake", train_step=train_step, dims=REPLICAS)
    data = SyntheticData(WORKLOADS["cnn"], 0, config.batch_size)
    result = train(fake, None, data, config, Dist())
    assert len(calls) == 5 and len(result.step_s) == 3 and len(result.losses) == 5
    assert max(result.step_s) < 0.2, result.step_s  # none of the 0.3 s warm-up steps


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
        row, _ = execute(strategies.get("single"), small(workload=workload, batch_size=256, steps=40), Dist())
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
