"""Spawned gloo ranks inside pytest: the package's own runner (parallel/launch/ranks.py), and the parity
check the collective strategies' tests share."""

import dataclasses

from parallel import strategies
from parallel.judge import equivalence
from parallel.launch.ranks import RankError, run_ranks
from parallel.models.usermodel import workload_of
from parallel.world.dist import Dist

__all__ = ["FP64_MARGIN", "BF16_MARGIN", "RankError", "faulted_and_resumed", "judged_on_ranks", "run_ranks",
           "uninterrupted"]

# What an honest run may come to, as err/tol, before a test calls it a regression (docs/oracle.md, "Honest
# noise against injected bugs, 10 seeds"). The verdict itself is the oracle's (at most 1); a margin catches
# noise that grew.
FP64_MARGIN = 0.01  # of the fp64 rule: 25x the largest of 1,110 honest fp64 runs (4.1e-4); bugs from 10.8
BF16_MARGIN = 0.5  # of the bf16 rule: 1.9x the worst of the token models' 10-seed bf16 table on today's data
NORMALISED_MARGIN = 0.8  # of bf16's rule under AdamW (equivalence.BF16_NORMALISED): 1.4x the worst honest run's
#   (0.264, the MoE under manual_tp on cpu:2; the transformer's worst 0.035; docs/oracle.md, 2026-11-29)


def _train(rank, world, runs, make_config):
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    out = []
    for name, workload, options in runs:
        row, state = _execute(strategies.get(name), _sharp(make_config(workload, world, options)), dist)
        out.append((row, state if rank == 0 else None))
    return out


def _sharp(config):
    """The run in float64 (--precision fp64), unless it asks for bf16: rounding there is too fine to flip a
    ReLU or a max-pool, so any difference from `single` is a bug (docs/oracle.md: in fp32 a flipped
    decision alone moved a tensor by up to 2.9x the fp32 rule, on some seeds and machines)."""
    return config if config.precision.startswith("bf16") else dataclasses.replace(config, precision="fp64")


def _execute(strategy, config, dist):
    from parallel.worker import execute

    return execute(strategy, config, dist)


def judged_on_ranks(world: int, runs: list, make_config, timeout: float = 150) -> list:
    """Every (strategy, workload, options) of `runs` trained in one set of `world` spawned ranks, each
    judged by the oracle against `single` on the same config (make_config(workload, world, options), a
    module-level function: the ranks import it); the rows, in order. Each run in float64 unless it asks for
    bf16 (_sharp); its verdict must be a match within the margin measured for its precision."""
    refs, out = {}, []
    results = run_ranks(_train, world, (runs, make_config), timeout=timeout)[0]
    for (name, workload, options), (row, state) in zip(runs, results, strict=True):
        config = _sharp(make_config(workload, world, options))
        key = (workload_of(config), config.precision)  # the model as built (--seq-len, --aux-loss), its precision
        if key not in refs:
            refs[key] = equivalence.reference_of(config, *_execute(strategies.get("single"), config, Dist()))
        verdict = equivalence.judge(strategies.get(name), config, refs[key], row, state)
        margin = NORMALISED_MARGIN if verdict.basis == equivalence.BF16_NORMALISED.basis else \
            BF16_MARGIN if config.precision.startswith("bf16") else FP64_MARGIN
        assert verdict.verdict == "match" and verdict.ratio < margin, (name, workload, options, verdict)
        if config.check_replicas:  # an honest run: every replica that must agree did, at every step
            assert row.details.get("replicas_checked") is not None and not row.details.get("replicas_diverged"), (
                name, workload, options, row.details.get("replicas_diverged"))
        out.append(row)
    return out


def _uninterrupted(rank, world, name, config_json):
    from parallel.config import RunConfig

    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    row, state = _execute(strategies.get(name), RunConfig.from_json(config_json), dist)
    return (row.final_loss, state) if rank == 0 else None


def uninterrupted(name: str, config) -> tuple[float, dict]:
    """(final loss, final state) of `name` trained without a fault on config.world_size spawned ranks: the
    reference a restarted torchrun launch of the same run must end at bitwise (the same code, thread count
    and gloo all-reduce; only the launcher differs), for a fraction of a launch's cost."""
    return run_ranks(_uninterrupted, config.world_size, (name, config.to_json()), timeout=120)[0]


def faulted_and_resumed(rank: int, world: int, name: str, folder: str, **fields) -> dict:
    """In a spawned rank: `name` trained three times, 4 steps (1 warm-up) with checkpoints every 2:
    uninterrupted (in FOLDER/whole); failing on every rank before step 3, the job killed, nothing left
    waiting in a collective (FOLDER/faulted); re-run from the checkpoint after step 1, so steps 2 and 3 run
    from the saved state. {run: rank 0's final state (None on the others), or the
    fault's message}; `fields`: the run's own RunConfig fields (workload, options, ...)."""
    from parallel.config import RunConfig
    from parallel.loop.faults import InjectedFault

    out = {}
    for run, fail, resume in (("whole", False, False), ("interrupted", True, False), ("resumed", False, True)):
        config = RunConfig(**{"devices": f"cpu:{world}", "steps": 3, "warmup": 1, **fields},
                           out=f"{folder}/{'whole' if run == 'whole' else 'faulted'}", checkpoint_every=2,
                           fail_at_step=3 if fail else -1, fail_rank=rank, resume=resume).validate()
        try:
            row, state = _execute(strategies.get(name), config, Dist(rank, rank, world, world))
        except InjectedFault as e:
            out[run] = str(e)
            continue
        # a resume that started again from step 0 would end bitwise equal too: it trains steps 2 and 3 alone
        assert not resume or len(row.losses) == 2, f"{name} resumed with {len(row.losses)} steps, not 2"
        out[run] = state if rank == 0 else None
    return out
