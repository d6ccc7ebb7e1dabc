"""Spawned gloo ranks inside pytest: the package's own runner (parallel/harness/ranks.py), and the parity
check the collective strategies' tests share."""

from parallel import strategies
from parallel.dist import Dist
from parallel.harness import equivalence
from parallel.harness.ranks import RankError, run_ranks
from parallel.usermodel import workload_of

__all__ = ["RankError", "judged_on_ranks", "run_ranks"]


def _train(rank, world, runs, make_config):
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    out = []
    for name, workload, options in runs:
        row, state = _execute(strategies.get(name), make_config(workload, world, options), dist)
        out.append((row, state if rank == 0 else None))
    return out


def _execute(strategy, config, dist):
    from parallel.worker import execute

    return execute(strategy, config, dist)


def judged_on_ranks(world: int, runs: list, make_config, timeout: float = 150) -> list:
    """Every (strategy, workload, options) of `runs` trained in one set of `world` spawned ranks, each
    judged by the oracle against `single` on the same config (make_config(workload, world, options), a
    module-level function: the ranks import it); the rows, in order. The oracle's own tolerance: a split
    computation adds its parts in another order than one device does, so the difference is float noise,
    far below it (asserted: under a tenth of it)."""
    refs, out = {}, []
    results = run_ranks(_train, world, (runs, make_config), timeout=timeout)[0]
    for (name, workload, options), (row, state) in zip(runs, results, strict=True):
        config = make_config(workload, world, options)
        key = (workload_of(config), config.precision)  # the model as built (--seq-len, --aux-loss), its precision
        if key not in refs:
            refs[key] = equivalence.reference_of(config, *_execute(strategies.get("single"), config, Dist()))
        verdict = equivalence.judge(strategies.get(name), config, refs[key], row, state)
        assert verdict.verdict == "match" and verdict.ratio < 0.1, (name, workload, options, verdict)
        out.append(row)
    return out
