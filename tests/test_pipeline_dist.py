"""Pipelines across processes on gloo ranks spawned inside pytest: pipeline_dist (torch.distributed.pipelining)
with each of torch's seven schedules on the MLP and the CNN (two on the transformer) on 2 ranks, and fsdp_pp
(FSDP2 x pipelining) on 4. Parity with `single`, the bubble's theory, point-to-point bytes, what each rank holds, and
the refusals. (The registry's parity test in test_oracle.py runs pipeline_dist's default too; its bug and
fsdp_pp's are in the mutants.)"""

import dataclasses

import pytest

from parallel import strategies
from parallel.config import ConfigError, RunConfig
from parallel.kit import schedules
from parallel.measure import pipelines
from parallel.strategies.model import pipeline_dist
from tests.multirank import judged_on_ranks

pytestmark = pytest.mark.timeout(300)
BATCH = 32  # 4 micro-batches of 8 (torch's stages need equal micro-batches: refused otherwise)

# Every schedule this torch runs over gloo (torch 2.11 cannot start a V schedule there: see the last test).
RUNS_HERE = [s for s, row in pipeline_dist.SCHEDULES.items() if not schedules.torch_lacks(row.cls, "gloo")]
# Every schedule on the MLP and the CNN; on the transformer (a run costs 3x theirs) a flat one and a V
# (or a looped one where this torch runs no V over gloo): the schedules do not look at the layers they run.
ON_TRANSFORMER = ["1f1b", next(s for s in ("zbv", "interleaved1f1b") if s in RUNS_HERE)]
TWO = [("pipeline_dist", w, {"schedule": s, "microbatches": 4}) for w in ("mlp", "cnn") for s in RUNS_HERE] + [
    ("pipeline_dist", "transformer", {"schedule": s, "microbatches": 4}) for s in ON_TRANSFORMER]
FOUR = [("fsdp_pp", "mlp", {"pp": 2, "schedule": "1f1b", "microbatches": 2, "check_replicas": True}),
        ("fsdp_pp", "transformer", {"pp": 2, "schedule": "interleaved1f1b", "microbatches": 2})]


def _config(workload: str, world: int, options: dict) -> RunConfig:
    options = dict(options)
    replicas = options.pop("check_replicas", False)  # an honest run raises no false alarm (judged_on_ranks)
    return RunConfig(workload=workload, devices=f"cpu:{world}", batch_size=BATCH if world == 2 else 2 * BATCH,
                     steps=3, warmup=1, check_replicas=replicas, options={"balance": "params", **options}).validate()


def _judged(world: int, runs: list) -> list:
    return judged_on_ranks(world, runs, _config)


@pytest.mark.slow
def test_every_torch_schedule_matches_single_on_every_workload():
    rows = _judged(2, TWO)
    for (_, _, options), row in zip(TWO, rows, strict=True):
        d, p, m = row.details, pipelines.result(row), row.measured
        v = 1 if options["schedule"] in ("gpipe", "1f1b") else 2
        stages = p.stages.split(" | ")
        assert len(stages) == 2 * v and len(p.peak_activation_bytes) == 2 * v and p.v == v, (options, p)
        if options["schedule"] in ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs"):  # closed forms free of times
            assert m.bubble_theory == pytest.approx(1 / (v * 4 + 1)), options
        assert 0 < m.bubble_measured < 1 and all(0 <= f < 1 for f in p.rank_idle_fraction)
        # every rank's actions replayed on this run's pieces; what each stage held is what its order holds
        assert 0 <= m.bubble_replayed < 1 and p.replayed_step_ms > 0 and p.hop_ms, options
        assert p.held_measured == p.held_predicted, (options, p.held_measured, p.held_predicted)
        assert d["bytes_per_step_by_collective"]["send"] > 0  # activations forward, gradients back: point to point
        # a pipeline has no collective but the clip's gradient norm, one float64 over the stages (AdamW's runs)
        assert d["bytes_per_step_by_collective"].get("all_reduce", 0) == (8.0 if row.grad_norms else 0)
        # each rank holds its own stages only: the two ranks' model state adds up to one model's
        held = d["model_state_bytes_per_device"]
        assert len(held) == 2 and all(b > 0 for b in held)
    by = {(w, o["schedule"]): r for (_, w, o), r in zip(TWO, rows, strict=True)}
    whole = sum(by[("mlp", "gpipe")].details["model_state_bytes_per_device"])
    assert all(sum(by[("mlp", s)].details["model_state_bytes_per_device"]) == whole for s in RUNS_HERE)
    # 1F1B starts a micro-batch's backward before the next forward: the first stage holds fewer at once
    assert (pipelines.result(by[("cnn", "1f1b")]).peak_activation_bytes[0]
            < pipelines.result(by[("cnn", "gpipe")]).peak_activation_bytes[0])


@pytest.mark.slow
def test_fsdp_x_pipelining_matches_single_on_four_ranks():
    rows = _judged(4, FOUR)
    for row in rows:
        sent = row.details["bytes_per_step_by_collective"]
        assert pipelines.result(row).mesh == "pp 2 x dp_shard 2"
        assert {"send", "all_gather", "reduce_scatter"} <= set(sent)  # between stages, and within one


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "pipeline_dist", "--devices", "cpu:2", "--schedule", "zbv", "--stages-per-rank", "3"],
     "exactly 2 per rank"),
    (["--strategies", "pipeline_dist", "--devices", "cpu:2", "--schedule", "1f1b", "--stages-per-rank", "2"],
     "one stage per rank"),
    (["--strategies", "pipeline_dist", "--devices", "cpu:4", "--workload", "transformer",
      "--schedule", "interleaved1f1b"], "8 stages, but the transformer has 4 layers"),
    (["--strategies", "pipeline_dist", "--devices", "cpu:2", "--schedule", "interleaved1f1b", "--microbatches", "5",
      "--batch-size", "40"], "not a multiple of its 2 rounds"),
    (["--strategies", "pipeline_dist", "--devices", "cpu:2", "--microbatches", "3"], "must divide the 512 samples"),
    (["--strategies", "fsdp_pp", "--devices", "cpu:4", "--dp-mode", "ddp"], "internal assert"),
    (["--strategies", "fsdp_pp", "--devices", "cpu:4", "--schedule", "zbv"], "zero-bubble"),
    (["--strategies", "fsdp_pp", "--devices", "cpu:4", "--schedule", "dualpipev"], "31x for dualpipev"),
    (["--strategies", "pipeline_dist", "--devices", "cpu:2", "--workload", "transformer", "--schedule", "dualpipev",
      "--microbatches", "2"], "needs at least as many micro-batches as its 4 stages"),
    (["--strategies", "fsdp_pp", "--devices", "cpu:4", "--pp", "4"], "data-parallel groups of at least 2"),
    (["--strategies", "pipeline_dist", "--workload", "dcgan", "--devices", "cpu:2"], "two optimisers"),
])
def test_refusals_name_the_numbers(refused, argv, message):
    refused(["compare", *argv], message)


def test_the_report_explains_a_bubble_well_over_its_theory_and_shows_every_pipeline_row():
    from parallel.loop.results import Measured, Row

    def row(name, idle, busy):
        result = pipelines.Result("params", "0-2 | 3-11", [0, 3, 12], "1f1b", 4, busy_ms=busy,
                                  peak_activation_bytes=[9e6, 2e6])
        return Row(name, "", "torchrun", "cpu:2", "virtual", 2, 64, step_ms_p50=20.0, step_ms_predicted=15.0,
                   measured=Measured(bubble_measured=idle, bubble_theory=0.2),
                   details={"pipelines": dataclasses.asdict(result), "model_state_bytes_per_device": [1e3, 4e5]})

    near, unequal, equal = row("a", 0.22, [14.0, 12.0]), row("b", 0.34, [14.4, 12.1]), row("c", 0.34, [13.0, 13.2])
    lines = pipelines.gaps([near, unequal, equal])
    assert len(lines) == 2  # 22% against 20% is within a quarter of the theory: nothing to explain
    assert "faster stage waits" in lines[0] and "hand-offs" in lines[1]
    replayed = row("d", 0.34, [14.4, 12.1])  # the replay prices unequal stages: the rest is between the pieces
    replayed.measured.bubble_replayed = 0.25
    replayed.details["pipelines"] |= {"replayed_step_ms": 18.0, "held_measured": [2, 1], "held_predicted": [2, 1]}
    assert "between pieces" in pipelines.gaps([replayed])[0]
    table = pipelines.table([near, unequal, equal, replayed])
    assert table.row_count == 4 and "34% (25%)" in table.columns[3]._cells and "2 1 (2 1)" in table.columns[6]._cells


def test_an_older_torch_without_scale_grads_is_refused_not_run(monkeypatch):
    import torch.distributed.pipelining.schedules as torch_schedules

    class Old:  # a schedule as older releases wrote it: no scale_grads switch
        def __init__(self, stage, n_microbatches, loss_fn=None):
            pass

    monkeypatch.setattr(torch_schedules, "Schedule1F1B", Old)
    assert "scale_grads" in schedules.torch_lacks("Schedule1F1B")
    assert schedules.torch_lacks("ScheduleGPipe") is None
    assert "lacks" in schedules.torch_lacks("ScheduleNotInThisTorch")


def test_a_v_schedule_over_gloo_is_refused_where_torch_would_send_from_a_rank_to_itself(monkeypatch):
    from torch.distributed.pipelining import PipelineStage

    monkeypatch.delattr(PipelineStage, "_warmup_forward_vote", raising=False)  # torch 2.11's warm-up
    assert "sending from a rank to itself" in schedules.torch_lacks("ScheduleDualPipeV", "gloo")
    assert schedules.torch_lacks("ScheduleDualPipeV", "nccl") is None  # not refused there: left to torch
    assert schedules.torch_lacks("Schedule1F1B", "gloo") is None  # a loop: no stage pair within a rank


def _bounds_by_time(rank, world):
    """pipeline_dist's cut by time on a rank (stages.agreed_cut), with every point-to-point send recorded
    and the same-device copy that priced the hop before made to fail."""
    import torch
    import torch.distributed as td

    from parallel.kit import stages
    from parallel.models.usermodel import workload_of
    from parallel.world.dist import Dist

    sent, send = [], td.send

    def spied(tensor, *args, **kwargs):
        if tensor.dtype == torch.uint8:
            sent.append(tensor.numel())
        return send(tensor, *args, **kwargs)

    def copied(*args):
        raise AssertionError("the hop between ranks priced as a copy on one device")

    td.send, stages._copy_there_and_back = spied, copied
    config = _config("cnn", world, {"balance": "time", "microbatches": 4})
    layers = stages.layers_of(workload_of(config).build_model(config.seed))
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    run = strategies.get("pipeline_dist").run(config)
    o = run.options
    return stages.agreed_cut(layers, world, o.balance, run, dist, -(-BATCH // o.microbatches)), sent


def test_the_cut_by_time_prices_the_hop_as_a_send_between_ranks():
    import torch

    from parallel.kit.stages import layers_of
    from parallel.models.usermodel import workload_of
    from tests.multirank import run_ranks

    (bounds, sent0), (same, sent1) = run_ranks(_bounds_by_time, 2, timeout=60)
    assert bounds == same and bounds[0] == 0 and bounds[-1] == 12  # rank 0 decides, every rank cuts alike
    config = _config("cnn", 2, {"balance": "time", "microbatches": 4})
    x, outputs = workload_of(config).dataset(config.seed, BATCH // 4).batch(0)[0], []
    with torch.no_grad():
        for layer in layers_of(workload_of(config).build_model(config.seed)):
            x = layer(x)
            outputs.append(x.numel() * x.element_size())
    # each layer's output goes to rank 1 and comes back (its gradient): a warm-up and 5 timed round trips
    assert sent0 == [n for n in outputs for _ in range(6)] and sent1 == sent0


def test_every_stage_holds_parameters_where_the_model_allows():
    # Seen on cpu:3: the CNN cut by measured time once gave rank 1 only a ReLU and a pooling layer, whose
    # process then had no parameters for its optimiser ("optimizer got an empty parameter list").
    from parallel.kit import stages

    holds = [True, False, False, True, False, False, False, True, False, True, False, True]  # the CNN's layers
    costs = [9.0, 0.1, 5.0, 3.0, 0.1, 0.1, 0.1, 0.2, 0.1, 0.1, 0.1, 0.1]  # a slow ReLU-and-pool pair after conv1
    alone = stages.partition(costs, 3)  # by time alone, a stage of ReLU and pooling
    assert not all(any(holds[a:b]) for a, b in zip(alone, alone[1:], strict=False)), alone
    bounds = stages.partition(costs, 3, holds=holds)
    assert all(any(holds[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)), bounds
    config = RunConfig(workload="cnn", devices="cpu:8").validate()
    with pytest.raises(ConfigError, match="only 5 of the cnn's layers have parameters"):
        strategies.get("pipeline_dist").validate(config)


@pytest.mark.parametrize("schedule, per_rank, run, says", [
    ("1f1b", -1, {}, "must be 0"),
    ("1f1b", 2, {}, "runs one stage per rank"),
    ("interleaved1f1b", 1, {}, "loops over several stages per rank"),
    ("zbv", 3, {}, "exactly 2 per rank"),
    ("gpipe", 0, {"p": 2, "m": 3, "batch": 8}, "must divide the 8 samples"),
    ("gpipe", 0, {"p": 1}, "at least 2 processes"),
    ("gpipe", 0, {"p": 4, "layers": 3, "holding": 3}, "4 stages, but the model has 3 layers"),
    ("gpipe", 0, {"p": 4, "layers": 6, "holding": 3}, "only 3 of the model's layers have parameters"),
    ("1f1b", 0, {"p": 4, "m": 2, "batch": 8, "layers": 8, "holding": 8}, "micro-batches as stages: 2 < 4"),
    ("dualpipev", 0, {"p": 2, "m": 2, "batch": 8, "layers": 8, "holding": 8}, "as its 4 stages"),
    ("interleaved1f1b", 0, {"p": 4, "m": 9, "batch": 9, "layers": 8, "holding": 8}, "rounds of 4"),
])
def test_each_rule_of_a_schedules_row_breaks_with_its_own_message(schedule, per_rank, run, says):
    run = {"m": 1, "batch": 1, "layers": 64, "holding": 64} | run
    assert says in schedules.broken_rule(schedule, per_rank, **run)
    assert schedules.broken_rule(schedule, 0, p=2, m=8, batch=8, layers=64, holding=64) is None  # a sound run
