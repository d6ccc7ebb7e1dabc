"""The training step people run (loop/optim.py, loop/clipping.py; docs/optimizer.md): AdamW's weight-decay
groups by a stated rule, the schedule, the flags' refusals, the global gradient norm counted once per
gradient whatever the layout (in spawned gloo ranks), and, slow, every layout under AdamW with the clip
biting against `single`, and a resume under AdamW bitwise."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from parallel.config import ConfigError, RunConfig
from parallel.loop import optim
from parallel.loop.clipping import Step
from parallel.models.workloads import WORKLOADS
from parallel.world.dims import ParallelDims
from parallel.world.dist import Dist
from tests.multirank import faulted_and_resumed, judged_on_ranks, run_ranks

pytestmark = pytest.mark.timeout(240)


def test_kinds_are_decided_by_what_a_parameter_is():
    model = WORKLOADS["transformer"].build_model(0)
    kinds = optim.tag(model, WORKLOADS["transformer"].classes)
    assert kinds["embed.tokens.weight"] == "embedding" and kinds["blocks.0.attn.q.weight"] == "matrix"
    assert kinds["blocks.0.attn.q.bias"] == "vector" and kinds["head.1.weight"] == "head"
    assert all(k == "vector" for n, k in kinds.items() if "norm" in n or n.endswith(".bias"))
    gpt = RunConfig(workload="transformer", arch="gpt", tied=True, vocab=64, seq_len=16).validate()
    from parallel.models.usermodel import workload_of
    w = workload_of(gpt)
    tied = optim.tag(w.build_model(0), w.classes)
    assert "embedding" in tied.values() and "head" not in tied.values()  # the tied head is the embedding


def test_groups_split_what_decays_from_what_does_not_and_keep_their_keys():
    recipe = optim.Recipe(RunConfig(workload="transformer").validate())
    a, b = optim.tag_as(nn.Parameter(torch.ones(2, 2)), "matrix"), optim.tag_as(nn.Parameter(torch.ones(2)), "vector")
    groups = recipe.groups([{"params": [a, b], "mesh": "m"}])
    assert [(g["weight_decay"], g["mesh"], len(g["params"])) for g in groups] == [(0.1, "m", 1), (0.0, "m", 1)]
    with pytest.raises(RuntimeError, match="without a kind"):  # a wrapper that dropped the kind is our bug
        recipe.groups([nn.Parameter(torch.ones(3))])


def test_the_schedule_warms_up_then_decays_to_a_tenth():
    recipe = optim.Recipe(RunConfig(workload="transformer", lr_schedule="cosine", warmup_steps=2, steps=8,
                                    warmup=2).validate())
    f = [recipe.factor(s) for s in range(10)]
    assert f[:3] == [0.5, 1.0, 1.0] and f[2] > f[5] > f[9] > optim.MIN_LR_FACTOR
    assert optim.Recipe(RunConfig().validate()).factor(7) == 1.0


def test_adamw_where_a_transformer_trains_sgd_elsewhere():
    t, c = RunConfig(workload="transformer").validate(), RunConfig(workload="cnn").validate()
    assert (t.optimizer, t.lr, t.weight_decay, t.clip_norm) == ("adamw", 3e-3, 0.1, 1.0)
    assert (c.optimizer, c.lr, c.weight_decay, c.clip_norm) == ("sgd", 0.02, 0.0, 0.0)
    assert RunConfig(workload="cnn", optimizer="adamw", lr=1e-3).validate().clip_norm == 1.0


@pytest.mark.parametrize("fields, message", [
    ({"optimizer": "lion"}, "--optimizer must be one of sgd, adamw"),
    ({"betas": "0.9"}, "--betas must be two numbers"), ({"betas": "0.9,1.5"}, "--betas must be two numbers"),
    ({"clip_norm": -1.0}, "--clip-norm must be 0"), ({"weight_decay": -0.1}, "--weight-decay must be 0"),
    ({"lr_schedule": "linear"}, "--lr-schedule must be one of"), ({"warmup_steps": -1}, "--warmup-steps must be"),
    ({"lr": 0.0}, "--lr must be a positive")])
def test_bad_flags_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(workload="transformer", **fields).validate()


def _norms(rank, world):
    """Each layout's global norm on this rank, and the norm of the whole gradient it stands for."""
    torch.manual_seed(0)
    whole = torch.randn(12, dtype=torch.float64)  # the model's whole gradient, every rank alike
    recipe = SimpleNamespace(clip=1e9, factor=lambda s: 1.0)  # a clip that never bites: the norm only
    dist = Dist(rank, rank, world, world)

    def norm(params, model, dims, **fields):
        t = SimpleNamespace(model=model, optimizer=torch.optim.SGD(params, lr=0.1), held_by={}, grad_copies={},
                            clip_alone=False) if "t" not in fields else fields["t"]
        for k, v in fields.items():
            setattr(t, k, v)
        step = Step(t, recipe, dims, dist)
        t.optimizer.step()
        step.close()
        return step.norms()[""][0]

    def param(values):
        p = nn.Parameter(torch.zeros_like(values))
        p.grad = values.clone()
        return p

    out = {"whole": float(whole.norm())}
    replicas = [param(whole[:6]), param(whole[6:])]  # DDP: every rank the whole gradient, no all-reduce
    out["replicated"] = norm(replicas, nn.ParameterList(replicas), ParallelDims.data_parallel(world))
    own = param(whole.chunk(world)[rank])  # ZeRO's chunk, a tensor only the optimiser holds: summed
    out["sharded"] = norm([own], nn.ParameterList(), ParallelDims.data_parallel(world))
    split, kept = param(whole[:8].chunk(world)[rank]), param(whole[8:])  # a tp slice, and a norm left whole
    model = nn.ParameterList([split, kept])
    out["held_by"] = norm([split, kept], model, ParallelDims(world=world, tp=world),
                          held_by={"1": tuple(range(world))})
    first, tie = param(whole[:8].chunk(world)[rank]), param(whole[8:])  # a stage each, a tied weight on both
    out["tied"] = norm([first, tie], nn.ParameterList([first, tie]), ParallelDims(world=world, pp=world),
                       grad_copies={id(tie): world})
    alone = param(whole.chunk(world)[rank])  # the injected bug: this rank's own norm
    out["alone"] = norm([alone], nn.ParameterList([alone]), ParallelDims(world=world, pp=world), clip_alone=True)
    out["own"] = float(whole.chunk(world)[rank].norm())
    return out


def test_the_global_norm_counts_every_gradient_once_whatever_the_layout():
    for got in run_ranks(_norms, 2):
        for layout in ("replicated", "sharded", "held_by", "tied"):
            assert got[layout] == pytest.approx(got["whole"], rel=1e-12), layout
        assert got["alone"] == pytest.approx(got["own"]) and not math.isclose(got["alone"], got["whole"])


# ---- slow: every layout under AdamW, the clip biting every step, against `single` in float64


def _adamw(workload, world, options):  # judged_on_ranks imports it
    return RunConfig(workload="transformer", devices=f"cpu:{world}", batch_size=8, steps=3, warmup=1,
                     extras=False, optimizer="adamw", clip_norm=0.25, lr_schedule="cosine", warmup_steps=2,
                     check_replicas=True, options=options).validate()


@pytest.mark.slow
def test_every_layout_under_adamw_with_the_clip_biting_matches_single():
    runs = [(name, "transformer", {}) for name in ("ddp", "zero", "zero_optimizer", "fsdp", "manual_tp",
                                                   "tensor_parallel", "pipeline_dist", "context_parallel")]
    rows = judged_on_ranks(2, runs, _adamw)
    assert all(len(r.grad_norms[""]) == 4 and min(r.grad_norms[""]) > 0.25 for r in rows)  # it bit each step


RESUMED = ("ddp", "zero", "zero_optimizer", "fsdp", "manual_tp", "tensor_parallel")  # those that checkpoint


def _resumed(rank, world, folder):
    return {(name, run): v for name in RESUMED for run, v in faulted_and_resumed(
        rank, world, name, f"{folder}/{name}", workload="transformer", batch_size=8, optimizer="adamw",
        clip_norm=0.25, lr_schedule="cosine", warmup_steps=2,
        options={"zero_stage": 2, "bucket_mb": 1} if name == "zero" else {}).items()}


@pytest.mark.slow
def test_a_resume_under_adamw_and_a_schedule_ends_bitwise_like_an_uninterrupted_run(tmp_path):
    # Checkpoints after step 1 (torch.distributed.checkpoint, one file per rank): zero's parameters once and
    # each rank's moment chunks under keys of its own, at stage 2 in 1 MiB buckets, whose gradients live only
    # in the chunks; ZeroRedundancyOptimizer's moments by owner; FSDP2's and DTensor's shards. The ranks fail
    # before step 3; the re-run resumes at step 2, its schedule and Adam's step count where they were.
    got = run_ranks(_resumed, 2, (str(tmp_path),), timeout=200)[0]
    for name in RESUMED:
        whole, resumed = got[(name, "whole")], got[(name, "resumed")]
        assert got[(name, "interrupted")] == "injected fault at step 3 on rank 0 (--fail-at-step)", name
        assert sorted(p.name for p in (tmp_path / name / "faulted" / "checkpoints" / name).iterdir()) == [
            ".metadata", "__0_0.distcp", "__1_0.distcp"], name
        assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), name

