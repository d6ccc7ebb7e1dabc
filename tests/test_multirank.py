"""The in-pytest multi-rank helper itself: results come back in rank order, a failing rank is named with
its error, a rank that never joins a collective ends in the timeout instead of a hang."""

import time

import pytest
import torch
import torch.distributed as td

from tests.multirank import RankError, run_ranks

pytestmark = pytest.mark.timeout(90)


def _sum_of_ranks(rank, world):
    t = torch.tensor([float(rank + 1)])
    td.all_reduce(t)
    return t.item(), td.get_world_size()


def _rank_one_fails(rank, world):
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    td.barrier()


def _rank_one_hangs(rank, world):
    if rank == 1:
        time.sleep(60)
    td.all_reduce(torch.zeros(1))


def test_every_rank_runs_in_one_group_and_returns_in_rank_order():
    assert run_ranks(_sum_of_ranks, world=3) == [(6.0, 3)] * 3


def test_a_failing_rank_is_named_with_its_error():
    with pytest.raises(RankError, match="rank 1: ValueError: bad shard on rank 1"):
        run_ranks(_rank_one_fails, world=2, timeout=10)


@pytest.mark.slow
def test_a_rank_that_never_arrives_ends_in_the_timeout():
    start = time.monotonic()
    with pytest.raises((RankError, TimeoutError)):
        run_ranks(_rank_one_hangs, world=2, timeout=3)
    assert time.monotonic() - start < 40
