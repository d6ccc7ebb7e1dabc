"""manual_ddp, DDP by hand, against one device: gloo ranks spawned inside pytest (tests/multirank.py),
each running the strategy through the real worker, the parent running `single` on the whole batch."""

import types

import pytest
import torch

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import equivalence
from parallel.measure import sharded
from parallel.models.workloads import WORKLOADS
from parallel.worker import execute
from parallel.world.dist import Dist
from tests.multirank import FP64_MARGIN, run_ranks

pytestmark = pytest.mark.timeout(180)
WORKLOADS_RUN = ["mlp", "cnn", "transformer"]
VARIANTS = [{"naive": 1}, {"bucket_mb": 0.05}, {}]  # per-parameter hooks; several small buckets; the default (25)


def _config(workload: str, world: int, options: dict) -> RunConfig:
    return RunConfig(workload=workload, devices=f"cpu:{world}", batch_size=48, steps=3, warmup=1,
                     options=options, precision="fp64").validate()


def _train_every_variant(rank, world):
    """Every workload and variant in one spawn of the ranks (a spawn costs seconds, a run milliseconds);
    at 2 ranks the variants on the MLP only, the default variant of every workload being the registry's
    parity test's (test_oracle.py); at 3 ranks the default variant on every workload."""
    out = []
    for workload in WORKLOADS_RUN if world == 3 else ["mlp"]:
        for options in VARIANTS if world == 2 else [{}]:
            row, state = execute(strategies.get("manual_ddp"), _config(workload, world, options),
                                 Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world))
            out.append((workload, options, row, state if rank == 0 else None))
    return out


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.slow
def test_manual_ddp_trains_what_one_device_trains_and_counts_ring_bytes(world):
    results = run_ranks(_train_every_variant, world)[0]  # rank 0's
    for workload, options, row, state in results:
        config = _config(workload, world, options)
        ref = equivalence.reference_of(config, *execute(strategies.get("single"), config, Dist()))
        # 4 SGD steps on the same global batch of 48, each rank 48/N of it, in float64: the only difference
        # is the order of the sums (ranks, threads), rounding far inside the oracle's fp64 rule (tests/
        # multirank.py: FP64_MARGIN), which every bug of the mutation suite (a missing average, a bucket
        # not reduced) exceeds.
        verdict = equivalence.judge(strategies.get("manual_ddp"), config, ref, row, state)
        assert verdict.verdict == "match" and verdict.ratio < FP64_MARGIN, (workload, options, verdict)
        collectives = sharded.result(row).all_reduces_per_step
        # counted bytes = ring all-reduce of every gradient
        assert row.comm_bytes_per_step == pytest.approx(row.comm_bytes_predicted, rel=0.01)
        params = sum(1 for p in WORKLOADS[workload].build_model(0).parameters())
        assert collectives == (params if options.get("naive") else collectives) and collectives >= 1
        if options.get("bucket_mb"):
            assert collectives > 1, (workload, "several buckets expected")


def test_a_hook_that_is_not_declared_is_refused():
    from parallel.strategies import Strategy

    module = types.ModuleType("parallel.strategies.fake", "fake: a strategy with an undeclared hook")
    module.__dict__.update(NAME="fake", LAUNCH="inprocess", SYNCHRONOUS=True, setup=None, train_step=None)
    exec("def check(config):\n    pass\n", module.__dict__)  # defined here, with a hook's name, not in HOOKS
    with pytest.raises(TypeError, match="parallel.strategies.fake.check looks like a hook but is not in its HOOKS"):
        Strategy(module)


def test_an_imported_helper_never_becomes_a_hook():
    # pipeline imports model_parallel's functions; only what its HOOKS names is used.
    pipeline = strategies.get("pipeline")
    declared = strategies.get("model_parallel").model_state_bytes.__wrapped__  # the hook, as the module declares it
    assert pipeline.model_state_bytes.__wrapped__ is declared
    assert pipeline.world_size.__wrapped__ is strategies.base.world_size  # the default: nothing imported replaces it
    assert torch  # the module's own imports are not hooks either
