"""wire: bytes counted at the collectives, by kind, on 2 gloo ranks spawned inside pytest: torch.distributed's
calls, a functional (DTensor's) all-reduce, and a point-to-point send, each against the ring formula."""

import pytest
import torch
import torch.distributed as td

from parallel.kit import collectives
from parallel.loop import wire
from tests.multirank import run_ranks

pytestmark = pytest.mark.timeout(120)
N, ELEMS = 2, 600  # 600 fp32 elements: 2,400 bytes


def _collectives(rank, world):
    import torch.distributed._functional_collectives as funcol

    t, sent = torch.ones(ELEMS), {}
    with wire.counted(sent):
        td.all_reduce(t)
        td.broadcast(t, src=0)
        collectives.all_gather(torch.empty(ELEMS * world), torch.ones(ELEMS))  # the package's names for this torch's
        collectives.reduce_scatter(torch.empty(ELEMS // world), torch.ones(ELEMS))
        funcol.all_reduce(torch.ones(ELEMS), "sum", td.group.WORLD).wait()
        if rank == 0:
            td.send(torch.ones(ELEMS), dst=1)
        elif rank == 1:
            td.recv(torch.empty(ELEMS), src=0)
        td.barrier()
    counter = wire.Counter(steps=1)
    for _ in range(3):  # counts the first step only: the warm-up, off the clock
        with counter.step():
            td.all_reduce(torch.ones(ELEMS))
    return sent, counter.total, counter.counted, counter.per_step()


def test_each_collective_is_counted_at_the_bytes_a_ring_sends():
    payload = ELEMS * 4
    ranks = run_ranks(_collectives, N)
    for rank, (sent, total, counted, per_step) in enumerate(ranks):
        assert sent == pytest.approx({
            "all_reduce": 2 * 2 * (N - 1) / N * payload,  # torch.distributed's and the functional one
            "broadcast": (N - 1) / N * payload,
            "all_gather": (N - 1) * payload,  # its shard to each of the others: (N-1)/N of the output
            "reduce_scatter": (N - 1) / N * payload,
            **({"send": payload} if rank == 0 else {}),  # a receive is counted at its sender
        }), rank
        assert (total, counted) == (2 * (N - 1) / N * payload, 1) and per_step == {"all_reduce": total}


def test_other_operations_count_nothing():
    sent = {}
    with wire.counted(sent):
        torch.ones(3).add(1).sum()
    assert sent == {}


def _all_to_alls(rank, world):
    import torch.distributed._functional_collectives as funcol

    counts = []
    for run in (lambda: td.all_to_all_single(torch.empty(ELEMS), torch.ones(ELEMS)),  # equal chunks
                # uneven: rank 0 keeps 100 elements and sends 500; rank 1 sends 200 and keeps 400
                lambda: td.all_to_all_single(torch.empty(300 if rank == 0 else 900), torch.ones(ELEMS),
                                             [100, 200] if rank == 0 else [500, 400],
                                             [100, 500] if rank == 0 else [200, 400]),
                lambda: funcol.permute_tensor(torch.ones(ELEMS), [1, 0], td.group.WORLD).wait(),  # all to the peer
                lambda: td.all_to_all([torch.empty(ELEMS), torch.empty(ELEMS)], [torch.ones(ELEMS)] * world)):
        sent = {}
        try:
            with wire.counted(sent):
                run()
        except RuntimeError as e:  # the list form: torch 2.13's gloo has it, 2.11's refuses it (both run here)
            counts.append(str(e))
            continue
        counts.append(sent["all_to_all"])
    return counts


def test_an_all_to_all_is_counted_by_its_real_splits():
    """What each rank sends is its input but the chunk it keeps: permute_tensor's is all of it (counted as
    half before, as if split evenly), uneven splits as given."""
    b = 4  # bytes per element
    ranks = run_ranks(_all_to_alls, N)
    assert [r[:3] for r in ranks] == [[ELEMS // 2 * b, 500 * b, ELEMS * b], [ELEMS // 2 * b, 200 * b, ELEMS * b]]
    listed = [r[3] for r in ranks]  # all_to_all of a list: counted as the rest, where this torch's gloo has it
    assert listed == [ELEMS * b] * N or all("does not support alltoall" in str(x) for x in listed), listed
