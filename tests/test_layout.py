"""The parallel layout (parallel/world/dims.py) and what the loop asks of it, with gloo ranks inside pytest
where it takes a process group: the DeviceMesh, the loss averaged over the ranks that hold one, the
bytes a device holds of a sharded DTensor."""

import pytest
import torch

from parallel.config import ConfigError
from parallel.kit.tensors import param_bytes, state_bytes, tensor_bytes
from parallel.world.dims import ParallelDims
from parallel.world.dist import Dist
from tests.multirank import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_a_layout_that_does_not_fill_the_world_names_every_factor():
    with pytest.raises(ConfigError, match=r"^dp 2 x tp 2 x pp 1 = 4, but 6 processes$"):
        ParallelDims(world=6, dp_replicate=2, tp=2)
    with pytest.raises(ConfigError, match=r"dp 2 \(replicate\) x 2 \(shard\) x tp 1 x pp 2 = 8, but 4 processes"):
        ParallelDims(world=4, dp_replicate=2, dp_shard=2, pp=2)
    with pytest.raises(ConfigError, match="tp must be at least 1, got 0"):
        ParallelDims(world=2, tp=0)


def test_tensor_parallel_ranks_are_neighbours_and_share_a_batch():
    d = ParallelDims(world=8, dp_replicate=2, tp=2, pp=2)  # pp outermost, tp innermost
    assert d.coords(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 0}
    assert d.coords(1) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "cp": 0, "tp": 1}
    assert d.coords(2)["dp_replicate"] == 1 and d.coords(4)["pp"] == 1
    assert [d.batch_share(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]  # tp ranks: the same share
    assert [r for r in range(8) if d.counts_loss(r)] == [4, 6]  # last stage, one tp rank per group
    hsdp = ParallelDims(world=4, dp_replicate=2, dp_shard=2)
    assert [hsdp.batch_share(r) for r in range(4)] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert ParallelDims.data_parallel(3).batch_share(2) == (2, 3) and str(ParallelDims()) == "one process"


def _mesh_and_losses(rank, world):
    dims = ParallelDims(world=world, dp_replicate=2, tp=2)
    mesh = dims.mesh("cpu")
    me = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    # Ranks 0 and 2 hold the losses 1 and 3 (tp rank 0 of each group); ranks 1 and 3 hold a copy, here
    # made different (100) to show it is left out: the mean is 2, not the mean of all four.
    loss = torch.tensor([[1.0], [100.0], [3.0], [100.0]][rank])
    mean = me.all_reduce_mean(loss, counts=dims.counts_loss(rank)).item()
    return mesh.mesh_dim_names, tuple(mesh.shape), mean


def test_the_mesh_has_the_layout_and_the_loss_is_the_mean_of_the_ranks_that_hold_one():
    for names, shape, mean in run_ranks(_mesh_and_losses, world=4):
        assert names == ("dp_replicate", "tp") and shape == (2, 2) and mean == 2.0


def _shard_bytes(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    p = torch.nn.Parameter(distribute_tensor(torch.zeros(5, 4), mesh, [Shard(0)]))  # rows 3 + 2: uneven
    return p.numel(), param_bytes([p]), tensor_bytes(p, allocated=True), state_bytes([p], None)


@pytest.mark.slow
def test_a_device_counts_its_shard_of_a_dtensor_not_the_global_tensor():
    (n0, b0, a0, s0), (n1, b1, a1, s1) = run_ranks(_shard_bytes, world=2)
    assert n0 == n1 == 20  # numel() of a DTensor is the global size ...
    assert (b0, b1) == (3 * 4 * 4, 2 * 4 * 4)  # ... what each device holds is its rows
    assert (s0, s1) == (b0, b1) and a0 >= b0 and a1 >= b1


def test_plain_tensors_count_as_before():
    t = torch.zeros(10)
    assert tensor_bytes(t) == tensor_bytes(t, allocated=True) == 40


def test_a_v_placed_pipeline_counts_the_loss_of_its_first_rank():
    # zbv puts stages r and 2p-1-r on rank r: the last stage, and the loss, on pipeline rank 0
    assert [r for r in range(4) if ParallelDims(world=4, pp=4, loss_pp=0).counts_loss(r)] == [0]
    assert [r for r in range(4) if ParallelDims(world=4, pp=4).counts_loss(r)] == [3]
    assert ParallelDims(world=4, pp=2, dp_shard=2).batch_share(3) == (1, 2)  # pp outermost: dp is rank % 2


def test_context_parallel_ranks_share_a_batch_and_every_one_of_their_losses_counts():
    d = ParallelDims(world=4, dp_replicate=2, cp=2)  # cp inside dp: the ranks of one sequence are neighbours
    assert [d.coords(r)["cp"] for r in range(4)] == [0, 1, 0, 1]
    assert [d.batch_share(r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert all(d.counts_loss(r) for r in range(4))  # each holds the mean over its own slice
    assert str(d) == "dp_replicate 2 x cp 2"
