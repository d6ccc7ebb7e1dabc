"""Injected bugs that a diagnosis must name, in one line, beside the ones the oracle's verdict catches.

A Mutant says what catches it (base.Mutant.shows):
- "oracle": its verdict against `single` is a mismatch (the 39 before these);
- "hang": the run hangs or dies, and the diagnosis (judge/hangs.py) names a rank, a collective (its
  sequence number and op) and the step: `... rank 0 waits in #12 all_reduce(1024 fp32) (step 1) ...`.
  A run that only timed out, with no such line, is not caught;
- "replicas": --check-replicas (divergence.py) names the first step, the tensor and the ranks whose
  replicas part.

A hang bug runs in a set of ranks of its own (a group whose collective failed cannot go on to the next
run), with its run's short --pg-timeout, each rank writing its record as the harness's children do.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import diagnose
from parallel.launch.ranks import RankError, run_ranks
from parallel.loop import recorder
from parallel.loop.results import Equivalence
from parallel.worker import execute
from parallel.world.dist import Dist

# What a caught bug's line must hold: a rank, and a collective (#n op) or a tensor, and a step.
HANG_NAMED = re.compile(r"rank \d+\b.*#\d+ \w+\(.*\((step \d+|setting up)\)")
REPLICAS_NAMED = re.compile(r"step \d+\b.*\S+.*rank \d+")


def shows(label: str) -> str:
    """What catches the bug `label` ("oracle", "hang", "replicas"); "oracle" for an honest run."""
    found = strategies.mutants().get(label)
    return found[1].shows if found else "oracle"


def caught(o) -> bool:
    """Did what must catch this outcome's bug catch it, in one line where a diagnosis must name it?"""
    kind = shows(o.label)
    if kind == "hang":
        return o.equivalence.verdict == "named" and bool(HANG_NAMED.search(o.equivalence.reason))
    if kind == "replicas":
        return bool(o.named) and bool(REPLICAS_NAMED.search(o.named)) and "\n" not in o.named
    return o.equivalence.verdict == "mismatch"


def run_hang(job, folder: Path) -> tuple[Equivalence, float]:
    """Run a hang bug on its own ranks; the verdict "named" with the diagnosis, or "unnamed" with the error."""
    config = RunConfig.from_json(job.config)
    out = folder / f"{job.label.replace(':', '-')}-{config.devices.replace(':', '')}"  # each run its own
    start = time.perf_counter()
    try:
        run_ranks(_rank, config.world_size, (job.strategy, job.config, str(out)), timeout=config.pg_timeout,
                  total=config.timeout)
        return Equivalence("unnamed", reason="it ran to the end: no hang"), time.perf_counter() - start
    except (RankError, TimeoutError) as e:
        line = diagnose.explain(out, config.world_size)
        seconds = time.perf_counter() - start
        if line is None:
            return Equivalence("unnamed", reason=f"no record; {str(e).splitlines()[0]}"), seconds
        return Equivalence("named" if HANG_NAMED.search(line) else "unnamed", reason=line), seconds


def _rank(rank: int, world: int, name: str, config_json: str, folder: str) -> None:
    config = RunConfig.from_json(config_json)
    with recorder.recording(Path(folder), rank, config.pg_timeout):
        execute(strategies.get(name), config, Dist(rank=rank, local_rank=rank, world_size=world,
                                                   local_world_size=world))
