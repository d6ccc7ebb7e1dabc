"""--check-replicas (parallel/loop/divergence.py): exact checksums, which ranks must agree, the first step, tensor and
ranks that part, on two spawned gloo ranks with a data-parallel step written here; the flag through RunConfig and
the command line, and its note in the report."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as td
from torch import nn

from parallel.cli import build_parser
from parallel.cliargs import config_from_args
from parallel.config import RunConfig
from parallel.loop import divergence
from parallel.loop.results import Row
from parallel.report.notes import replica_lines
from parallel.strategies.base import Trainable
from parallel.world.dims import ParallelDims
from parallel.world.dist import Dist
from tests.multirank import run_ranks

pytestmark = pytest.mark.timeout(120)


def test_a_checksum_is_exact_and_sees_order():
    t = torch.linspace(-1, 1, 11)
    assert divergence.checksum(t).tolist() == divergence.checksum(t.clone()).tolist()
    nudged = t.clone()
    nudged[3] = torch.nextafter(nudged[3], torch.tensor(2.0))  # one ulp
    swapped = t.clone()
    swapped[[2, 7]] = swapped[[7, 2]]
    for other in (nudged, swapped):
        assert divergence.checksum(other).tolist() != divergence.checksum(t).tolist()
    odd_place = torch.arange(9, dtype=torch.bfloat16)[1:5]  # 2 bytes past a 4-byte boundary
    assert divergence.checksum(odd_place).tolist() == divergence.checksum(odd_place.clone()).tolist()
    for odd in (torch.ones(3, dtype=torch.bool), torch.arange(3, dtype=torch.int16), torch.ones(2, 3).t(), odd_place):
        assert divergence.checksum(odd).shape == (2,)  # any size, dtype and layout


def _entry(name, value, group=(0, 1)):
    return (name, group, ("torch.float32", (2,), value, value))


def test_compare_names_the_first_step_tensor_and_ranks():
    same = [[_entry("loss", 1), _entry("fc.weight.grad", 2), _entry("fc.weight", 3)]] * 2
    assert divergence.compare(same, step=4) is None
    parted = [same[0], [_entry("loss", 1), _entry("fc.weight.grad", 9), _entry("fc.weight", 8)]]
    assert divergence.compare(parted, step=4) == ("replicas part at step 4: fc.weight.grad differs between rank 0 "
                                                  "and rank 1 (they should hold the same replica)")
    missing = [same[0], [_entry("loss", 1), _entry("fc.weight", 3)]]
    assert divergence.compare(missing, step=0) == \
        "replicas part at step 0: fc.weight.grad is on rank 0 but not on rank 1"


def test_only_peers_are_compared():
    """Ranks 0, 1 hold one tensor-parallel pair's slices, 2, 3 the other's: only ranks in one group are held
    to the same bits (0 with 2, 1 with 3), whatever the others hold."""
    gathered = [[_entry("w", r % 2, group=(r % 2, r % 2 + 2))] for r in range(4)]
    assert divergence.compare(gathered, step=0) is None
    gathered[3] = [_entry("w", 7, group=(1, 3))]
    assert "w differs between rank 1 and rank 3" in divergence.compare(gathered, step=0)


def test_the_peers_of_a_plain_tensor_and_of_the_loss():
    dp_tp = ParallelDims(world=4, dp_replicate=2, tp=2)  # rank = dp * 2 + tp
    weight = torch.zeros(1)
    assert divergence.peers(weight, dp_tp, 0) == (0, 2)  # the other replica of the same tp slice
    assert divergence.peers(None, dp_tp, 3) == (2, 3)  # the loss: the tp pair of the same share
    dp_cp = ParallelDims(world=4, dp_replicate=2, cp=2)
    assert divergence.peers(weight, dp_cp, 1) == (0, 1, 2, 3)  # cp splits sequences, never weights
    assert divergence.peers(None, dp_cp, 1) == (1,)  # each cp rank's loss is over its own positions
    pp = ParallelDims(world=2, pp=2)
    assert [divergence.peers(None, pp, r) for r in (0, 1)] == [(), (1,)]  # the last stage alone holds the loss
    assert divergence.peers(weight, ParallelDims(world=2, dp_shard=2), 0) == (0,)  # a shard is its own


def _dtensor_peers(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dims = ParallelDims.data_parallel(world)  # what a plain tensor would follow; a DTensor follows its placements
    return [divergence.peers(distribute_tensor(torch.ones(4, 2), mesh, [p]), dims, rank)
            for p in (Shard(0), Replicate())]


def test_a_dtensor_is_compared_along_its_replicated_dimensions_only():
    assert run_ranks(_dtensor_peers, world=2) == [[(0,), (0, 1)], [(1,), (0, 1)]]


def _train(rank, world, perturb: str) -> str:
    """Three data-parallel steps written here (gradients all-reduced, then SGD), checked after each; on rank 1
    at step 1, `perturb` breaks one replica: "param" moves fc1.weight after the step, "grad" steps fc2.bias with
    the rank's own gradient instead of the mean."""
    torch.manual_seed(0)
    model = nn.ModuleDict({"fc1": nn.Linear(4, 8), "fc2": nn.Linear(8, 2)})  # the same weights on both ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    t = Trainable(model, optimizer, nn.functional.mse_loss, torch.device("cpu"))
    config, dims = SimpleNamespace(check_replicas=True), ParallelDims.data_parallel(world)
    check = divergence.Check(config, dims, Dist(rank, rank, world, world), t)
    for step in range(3):
        g = torch.Generator().manual_seed(step * world + rank)  # this rank's share of the step's batch
        x, y = torch.randn(5, 4, generator=g), torch.randn(5, 2, generator=g)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model.fc2(model.fc1(x).relu()), y)
        loss.backward()
        for name, p in model.named_parameters():
            own = p.grad.clone()
            td.all_reduce(p.grad)
            p.grad /= world
            if perturb == "grad" and step == 1 and rank == 1 and name == "fc2.bias":
                p.grad.copy_(own)  # the mean thrown away: this rank steps with its own share's gradient
        optimizer.step()
        if perturb == "param" and step == 1 and rank == 1:
            with torch.no_grad():
                model.fc1.weight[0, 0] += 1e-6
        check.after(step, loss)
    return check.found, check.checked


def test_two_ranks_that_stay_replicas_agree_at_every_step():
    assert run_ranks(_train, world=2, args=("",)) == [("", 3)] * 2


@pytest.mark.parametrize("perturb, line", [
    ("param", "replicas part at step 1: fc1.weight differs between rank 0 and rank 1 (they should hold the same "
              "replica)"),
    ("grad", "replicas part at step 1: fc2.bias.grad differs between rank 0 and rank 1 (they should hold the same "
             "replica)"),
])
def test_the_first_step_tensor_and_ranks_that_part_are_named(perturb, line):
    assert run_ranks(_train, world=2, args=(perturb,)) == [(line, 2)] * 2  # every rank; none compared after


def test_off_without_the_flag_or_a_second_rank():
    t = Trainable(nn.Linear(2, 2), None, None, torch.device("cpu"))
    dims = ParallelDims.data_parallel(1)
    assert not divergence.Check(SimpleNamespace(check_replicas=True), dims, Dist(), t).on
    assert not divergence.Check(SimpleNamespace(check_replicas=False), dims, Dist(), t).on


def test_the_flag_survives_the_config_and_the_command_line():
    config = RunConfig(check_replicas=True)
    assert RunConfig.from_json(config.to_json()).check_replicas
    args = build_parser().parse_args(["compare", "--devices", "cpu:2", "--check-replicas"])
    assert config_from_args(args, default_out=False).check_replicas
    assert not config_from_args(build_parser().parse_args(["run", "ddp"]), default_out=False).check_replicas


def test_the_report_names_a_row_that_parted_and_sums_up_the_rest():
    def row(label, details):
        return Row(strategy=label, variant="", launcher="torchrun", devices="cpu:2", device_kind="virtual",
                   world_size=2, global_batch=8, details=details)

    line = "replicas part at step 2: fc1.weight.grad differs between rank 0 and rank 1 (they should hold the same ...)"
    rows = [row("ddp", {"replicas_checked": 3, "replicas_diverged": line}),
            row("manual_tp", {"replicas_checked": 23, "replicas_diverged": ""}),
            row("fsdp", {"replicas_checked": 0, "replicas_diverged": ""}), row("single", {})]
    assert replica_lines(rows) == [f"ddp: {line}", "--check-replicas: every replica agreed at every step (manual_tp); "
                                                   "no two ranks hold a tensor alike in fsdp: nothing to compare"]
    assert replica_lines(rows[1:2]) == ["--check-replicas: every replica agreed at every step (manual_tp)"]
    assert replica_lines(rows[3:]) == []
    assert not rows[0].ok and rows[1].ok  # a row whose replicas parted fails the run (exit 1), as a mismatch does
