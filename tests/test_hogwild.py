"""Hogwild: shared memory really shared, convergence instead of parity, crashes surface, nothing orphaned."""

import multiprocessing

import pytest
import torch

from parallel import strategies
from parallel.config import ConfigError, RunConfig
from parallel.models.workloads import WORKLOADS, eval_loss
from parallel.worker import execute
from parallel.world.devicespec import DeviceSpec
from parallel.world.dist import Dist

pytestmark = pytest.mark.timeout(240)
HOGWILD = strategies.get("hogwild")


@pytest.mark.slow
def test_updates_made_in_the_workers_are_visible_in_the_parent():
    # The parent never trains: if the parameters were not shared, its copy would still be the initial one.
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0).validate()
    row, state = execute(HOGWILD, config, Dist())
    initial = WORKLOADS["cnn"].build_model(0).state_dict()
    assert all(not torch.equal(state[k], initial[k]) for k in initial if k.endswith("weight"))
    assert row.details["workers"] == 2 and 0 <= row.details["staleness_mean"] <= row.details["staleness_max"]
    assert all(rss > 50 * 2**20 for rss in row.details["process_peak_rss_per_worker"])  # each worker's own peak
    assert len(row.step_ms) == 2 * 2  # both workers' timed steps, through the same loop and clocks


def test_hogwild_converges_like_sgd_on_the_same_samples():
    # 60 steps of a global batch of 64 = 3840 samples for each run. Hogwild (2 workers x 32 per update)
    # makes twice the updates of `single` (64 per update), so the fair reference for what asynchrony costs
    # is sequential SGD with Hogwild's update size and count. Bands are on progress (how far the eval
    # loss fell from the initial 2.307), the scale on which runs differ. Measured: 20 runs in a row gave
    # 0.86-1.02 of sequential SGD's progress, 27 earlier ones at worst 0.90, 27 beside 1-3 busy processes
    # 0.81-1.02; but under the full suite's load a run now and then stalls on the CNN's plateau near the
    # initial loss (0.73 in CI, 0.46 on 2026-11-24, 0.09 on 2026-11-26: a bad interleaving early). Broken
    # sharing (each worker on a private copy) leaves the parent at the initial loss in every run:
    # progress 0. So the band is a quarter of the progress, and the verdict is the majority of up to three
    # runs: one stalled run is asynchrony, two of three are a bug.
    def run(strategy, batch, steps):
        config = RunConfig(workload="cnn", devices="cpu:2", batch_size=batch, steps=steps, warmup=0).validate()
        return eval_loss(WORKLOADS["cnn"], execute(strategies.get(strategy), config, Dist())[1], 0)

    initial = eval_loss(WORKLOADS["cnn"], WORKLOADS["cnn"].build_model(0).state_dict(), 0)
    best = min(run("single", 64, 60), run("single", 32, 120))  # the references: deterministic

    def progressed(loss: float) -> bool:
        return initial - loss >= 0.25 * (initial - best)

    runs: list[float] = []
    while len(runs) < 3 and 2 not in (sum(map(progressed, runs)), len(runs) - sum(map(progressed, runs))):
        runs.append(run("hogwild", 64, 60))
    assert sum(map(progressed, runs)) >= 2, (initial, best, runs)


@pytest.mark.slow
def test_a_crashed_worker_fails_the_run_and_leaves_no_process():
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=3, warmup=0, fail_at_step=1,
                       fail_rank=1).validate()
    with pytest.raises(RuntimeError, match="hogwild worker 1 failed: InjectedFault: injected fault at step 1"):
        execute(HOGWILD, config, Dist())
    assert multiprocessing.active_children() == []


def test_cuda_is_refused_with_a_reason_and_skipped_under_all():
    cuda = DeviceSpec("cuda", (0, 1))
    assert "CUDA is not supported" in HOGWILD.available(cuda)
    names, skipped = strategies.resolve(["all"], cuda, WORKLOADS["cnn"])
    assert "hogwild" not in names and "hogwild" in skipped
    with pytest.raises(ConfigError, match="hogwild cannot run on cuda:0,1"):
        strategies.resolve(["hogwild"], cuda, WORKLOADS["cnn"])
