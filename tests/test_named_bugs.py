"""The injected bugs a diagnosis must name (judge/named.py: a hang's, --check-replicas'), and the
vocabulary split the oracle names, on cpu:4 too: which rank gloo aborts, which receives the collective a
rank left out, and a vocabulary that 4 ranks split with a remainder of 3, not 1, depend on the ranks.
(On cpu:2 they run in the catalogue: test_mutants.py. A module of their own, so that `--dist loadfile`
runs them beside the catalogue, not after it.)"""

import dataclasses

import pytest

from parallel import strategies
from parallel.judge import mutants
from tests.test_mutants import _caught

pytestmark = pytest.mark.timeout(300)

ON_FOUR = ("manual_ddp:buckets-reordered", "manual_ddp:bucket-skipped", "zero:uneven-padding",
           "tensor_parallel:vocab-remainder-dropped", "manual_tp:rank-branch")


@pytest.fixture(scope="module")
def four_runs():
    catalogue, jobs = strategies.mutants(), []
    for name in ON_FOUR:
        strategy, mutant = catalogue[name]
        config = dataclasses.replace(mutants.mutant_config(mutant), devices="cpu:4", world_size=0).validate()
        strategy.validate(config)
        jobs.append(mutants.Job(strategy.name, config.to_json(), name))
    return mutants.run_jobs(jobs)


@pytest.mark.slow
def test_the_bugs_that_depend_on_the_ranks_are_caught_on_four_too(four_runs):
    assert [(o.label, o.devices) for o in four_runs] == [(name, "cpu:4") for name in ON_FOUR]
    for o in four_runs:
        eq = o.equivalence
        _caught(o.label, eq.verdict, eq.reason, eq.ratio, o.named)


@pytest.mark.slow
def test_a_head_that_dropped_the_vocabularys_remainder_on_four_ranks_keeps_60_rows(four_runs):
    (o,) = [o for o in four_runs if o.label == "tensor_parallel:vocab-remainder-dropped"]
    assert o.equivalence.reason.startswith("head.1.weight: shape (60, 128) != baseline (63, 128); loss first off "
                                           "at step 0: ") and o.equivalence.first_step == 0, o.equivalence
