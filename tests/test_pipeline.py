"""Model parallel and pipeline: the split, the schedules, parity with `single`, failures that do not hang."""

import itertools
import random

import pytest
import torch

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit import schedules, stages, tied
from parallel.measure import pipelines, stage_time
from parallel.models.workloads import WORKLOADS
from parallel.strategies.model import pipeline
from parallel.worker import execute
from parallel.world.dist import Dist
from tests.conftest import judged
from tests.multirank import FP64_MARGIN


def check_matches_single(name, workload, **options):
    # 6 optimiser steps on a global batch of 32 split over 2 stages, in float64 (tests/multirank.py:
    # FP64_MARGIN). model_parallel does the same arithmetic as `single`; the pipeline sums m micro-batch
    # gradients instead of one batch's: rounding only, far below the oracle's fp64 rule.
    config = RunConfig(workload=workload, devices="cpu:2", batch_size=32, steps=5, warmup=1, options=options,
                       precision="fp64").validate()
    row, verdict = judged(name, config)
    assert verdict.verdict == "match" and verdict.ratio < FP64_MARGIN, verdict
    return row


@pytest.mark.parametrize("workload", ["mlp", "cnn"])
def test_model_parallel_matches_single(workload):
    row = check_matches_single("model_parallel", workload)
    d, m = pipelines.result(row), row.measured
    assert m.bubble_theory == 0.5 and 0 < m.bubble_measured < 1  # one stage busy at a time
    assert len(d.param_bytes) == 2 and all(b > 0 for b in d.activation_bytes)


# Every schedule and micro-batch count on the CNN (0.2 s each); the MLP (2 s each) once per schedule.
@pytest.mark.parametrize("workload, microbatches, schedule", [
    *[("cnn", m, s) for m, s in [(1, "gpipe"), (4, "gpipe"), (8, "gpipe"), (4, "1f1b"), (8, "1f1b")]],
    ("mlp", 8, "gpipe"), ("mlp", 4, "1f1b")])
def test_pipeline_matches_single(workload, microbatches, schedule):
    row = check_matches_single("pipeline", workload, microbatches=microbatches, schedule=schedule)
    assert row.measured.bubble_theory == pytest.approx(1 / (microbatches + 1))


def test_1f1b_holds_fewer_activations_than_gpipe():
    peaks, rows = {}, {}
    for schedule in ("gpipe", "1f1b"):
        config = RunConfig(workload="cnn", devices="cpu:2", batch_size=64, steps=2, warmup=0,
                           options={"microbatches": 8, "schedule": schedule, "balance": "params"}).validate()
        rows[schedule] = execute(strategies.get("pipeline"), config, Dist())[0]
        peaks[schedule] = pipelines.result(rows[schedule]).peak_activation_bytes
    # Split by parameters: a split by measured time may cut the two runs differently on a loaded machine.
    # Stage 0 holds all 8 micro-batches under GPipe, at most p = 2 under 1F1B; stage 1 (last) holds 1.
    assert peaks["1f1b"][0] * 4 == peaks["gpipe"][0] and peaks["1f1b"][1] * 8 == peaks["gpipe"][1]
    # what the meter saw is what each schedule's order holds (replay.held), and the replay drew it
    gpipe, one_f_one_b = pipelines.result(rows["gpipe"]), pipelines.result(rows["1f1b"])
    assert gpipe.held_measured == gpipe.held_predicted == [8, 8]
    assert one_f_one_b.held_measured == one_f_one_b.held_predicted == [2, 1]
    assert [len(stage) for stage in one_f_one_b.replay_timeline] == [16, 16]
    assert stage_time.gantt(one_f_one_b.timeline, one_f_one_b.replay_timeline).startswith("<svg")


def test_partition_is_the_best_contiguous_split():
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.random() for _ in range(rng.randint(2, 9))]
        k = rng.randint(1, len(costs))
        bounds = stages.partition(costs, k)
        worst = max(sum(costs[a:b]) for a, b in itertools.pairwise(bounds))
        brute = min(max(sum(costs[a:b]) for a, b in itertools.pairwise((0, *cuts, len(costs))))
                    for cuts in itertools.combinations(range(1, len(costs)), k - 1))
        assert bounds[0] == 0 and bounds[-1] == len(costs) and worst == pytest.approx(brute)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_schedules_run_every_micro_batch_forward_then_backward(schedule):
    for p, m in [(2, 1), (2, 8), (4, 3), (4, 8)]:
        for s in range(p):
            ops = schedules.SCHEDULES[schedule](s, p, m)
            assert sorted(ops) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
            assert all(ops.index(("F", j)) < ops.index(("B", j)) for j in range(m))
            live = max(sum(1 for op, j in ops[:i] if op == "F") - sum(1 for op, j in ops[:i] if op == "B")
                       for i in range(len(ops) + 1))
            assert live == (m if schedule == "gpipe" else min(p - s, m))


def test_a_failing_stage_fails_the_step_without_hanging(monkeypatch):
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=2, warmup=0, pg_timeout=5,
                       options={"microbatches": 4}).validate()
    real = stages.stage_forward

    def fragile(stage, x, device, first, meter):
        if not first:
            raise ValueError("stage 1 broke")
        return real(stage, x, device, first, meter)

    monkeypatch.setattr(pipeline, "stage_forward", fragile)
    with pytest.raises(RuntimeError, match="pipeline stage failed: ValueError: stage 1 broke"):
        execute(strategies.get("pipeline"), config, Dist())


@pytest.mark.parametrize("argv, message", [
    (["--microbatches", "0"], "--microbatches must be at least 1, got 0"),
    (["--schedule", "zigzag"], "--schedule must be one of gpipe, 1f1b, got 'zigzag'"),
    (["--balance", "luck"], "--balance must be time or params, got 'luck'"),
    (["--microbatches", "1024"], "--microbatches 1024 is more than the global batch 512"),
])
def test_bad_pipeline_options_are_one_line_exit_2(argv, message, refused):
    refused(["compare", "--strategies", "pipeline", "--devices", "cpu:2", *argv], message)


def test_balance_by_params_puts_the_convolutions_together():
    # The CNN's convolutions hold 2k of its 30k parameters: counting parameters puts them all (and the
    # first linear layer's share) in one stage, whatever their cost.
    model = WORKLOADS["cnn"].build_model(0)
    sp = stages.split(model, [torch.device("cpu")] * 2, "params", torch.zeros(4, 1, 28, 28))
    assert sp.describe() == "0-7 | 8-11" and sp.balance == "params"


def test_simulate_gives_the_textbook_time_for_equal_stages_and_waits_for_the_slowest():
    from parallel.measure.stage_time import simulate

    for schedule in ("gpipe", "1f1b"):
        for p, m in ((2, 4), (3, 8), (4, 1)):
            ops = [schedules.SCHEDULES[schedule](s, p, m) for s in range(p)]
            # equal stages, F = 1, B = 2: (m + p - 1) slots of F and of B, whatever the order
            assert simulate(ops, [1.0] * p, [2.0] * p) == pytest.approx((m + p - 1) * 3), (schedule, p, m)
    # GPipe's forward phase runs at the slowest forward, its backward phase at the slowest backward:
    # stage 0 forward-heavy (F 3, B 1), stage 1 backward-heavy (F 1, B 3), m = 4: stage 0's 4 forwards,
    # stage 1's last forward, stage 1's 4 backwards, stage 0's last backward; equal stages of the same
    # total work (F 2, B 2) would take (m + p - 1) x 4 = 20
    ops = [schedules.gpipe(s, 2, 4) for s in range(2)]
    assert simulate(ops, [3.0, 1.0], [1.0, 3.0]) == pytest.approx(4 * 3 + 1 + 4 * 3 + 1)
    # a transfer between stages delays every hand-off
    assert simulate(ops, [1.0, 1.0], [1.0, 1.0], hop=0.5) > simulate(ops, [1.0, 1.0], [1.0, 1.0])


def test_a_weight_two_stages_use_gets_a_copy_in_each_and_their_gradients_summed():
    """tied.untie / sum_tied (Megatron's rule for a tied embedding and head): the copies start equal,
    are distinct objects, and after summing each holds the gradient the one weight gets on one device."""
    torch.manual_seed(0)
    embed, head = torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False)
    head.weight = embed.weight
    x = torch.tensor([[1, 4, 2]])
    head(embed(x)).square().sum().backward()
    want = embed.weight.grad.clone()  # one weight, both uses
    embed.weight.grad = None
    first, last = torch.nn.Sequential(embed), torch.nn.Sequential(head)
    groups = tied.untie([first, last])
    assert len(groups) == 1 and groups[0][0] is embed.weight and head.weight is groups[0][1]
    assert head.weight is not embed.weight and torch.equal(head.weight, embed.weight)
    h = embed(x).detach().requires_grad_()
    last(h).square().sum().backward()
    embed(x).backward(h.grad)
    tied.sum_tied(groups)
    assert torch.allclose(embed.weight.grad, want) and torch.equal(head.weight.grad, embed.weight.grad)
    assert tied.untie([torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.nn.Sequential(torch.nn.Linear(2, 2))]) == []
