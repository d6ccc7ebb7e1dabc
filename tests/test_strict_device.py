"""The strict CUDA stand-in's device rules (tests/strict_devices.py), the bug they were made for, and every
strategy's step under them.

Issue 45: on an H100, `compare --devices cuda:0 --strategies single,context_parallel` crashed in
context_parallel's local_loss, `b[:, s.index]` with the index on the GPU and the batch on the CPU
("indices should be either on cpu or on the same device as the indexed tensor (cpu)"). The stand-in of
the time put every tensor asked for on cuda:i on the CPU, where nothing could tell them apart; it now
marks where each would be and refuses what CUDA refuses."""

import math

import pytest
import torch
from torch import nn

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit.ring_attention import Split
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS
from parallel.strategies.model import context_parallel
from parallel.world.dist import Dist
from tests.multirank import run_ranks
from tests.strict_cuda import StrictCuda, on_cpu

pytestmark = pytest.mark.timeout(120)
MIXED = "Expected all tensors to be on the same device, but found at least two devices"
INDEX = r"indices should be either on cpu or on the same device as the indexed tensor \(cpu\)"


# ---- the rules


def test_tensors_of_two_devices_in_one_op_are_refused_as_cuda_refuses_them(strict_cuda):
    with on_cpu(strict_cuda):
        x = torch.ones(4, device="cuda:0")
        assert x.device == torch.device("cuda", 0) and x.is_cuda and x.get_device() == 0
        with pytest.raises(RuntimeError, match=f"{MIXED}, cuda:0 and cpu!"):
            x + torch.ones(4)
        with pytest.raises(RuntimeError, match=f"{MIXED}, cuda:0 and cuda:1!"):
            x * torch.ones(4, device="cuda:1")
        with pytest.raises(RuntimeError, match=MIXED):
            nn.Linear(4, 2).to("cuda:0")(torch.ones(3, 4))  # a layer on the GPU, its input left on the CPU
        assert (x + torch.ones(4, device="cuda:0")).device == x.device


def test_a_cpu_scalar_goes_with_a_gpu_tensor_as_torch_allows(strict_cuda):
    with on_cpu(strict_cuda):
        x = torch.ones(4, device="cuda:1")
        assert (x * torch.tensor(2.0)).device == x.device  # a 0-dim CPU tensor is a scalar
        with pytest.raises(RuntimeError, match=MIXED):
            x * torch.tensor([2.0])  # one element, but not a scalar


def test_moves_copy_between_devices_and_leave_the_original_where_it_was(strict_cuda):
    with on_cpu(strict_cuda):
        x = torch.arange(4.0)
        on_gpu = x.to("cuda:0")
        assert on_gpu is not x and on_gpu.device.type == "cuda" and x.device.type == "cpu"
        assert on_gpu.to("cuda:0") is on_gpu and on_gpu.cuda() is on_gpu  # already there: the tensor itself
        back = on_gpu.cpu()
        assert back.device.type == "cpu" and (back + x).tolist() == [0.0, 2.0, 4.0, 6.0]
        assert x.to(on_gpu).device == on_gpu.device  # .to(other): other's device
        assert torch.zeros(2, device=on_gpu.device).device == on_gpu.device  # "on x.device" is where x is
        on_gpu.copy_(torch.ones(4))  # a copy crosses devices, and stays where it was
        assert on_gpu.device.type == "cuda" and on_gpu.tolist() == [1.0] * 4
        assert ("to", 0) in strict_cuda.log


def test_a_cpu_index_into_a_gpu_tensor_is_taken_a_gpu_index_into_a_cpu_tensor_refused(strict_cuda):
    with on_cpu(strict_cuda):
        on_gpu, on_cpu_ = torch.arange(6.0, device="cuda:0"), torch.arange(6.0)
        index = torch.tensor([1, 3])
        assert on_gpu[index].device == on_gpu.device and on_gpu[index].tolist() == [1.0, 3.0]
        with pytest.raises(RuntimeError, match=INDEX):
            on_cpu_[index.to("cuda:0")]
        with pytest.raises(RuntimeError, match=INDEX):
            on_cpu_[(on_cpu_ > 2.0).to("cuda:0")] = 0.0  # a mask on the GPU, written through


def test_a_model_moved_to_a_gpu_trains_there_backward_and_optimizer_included(strict_cuda):
    with on_cpu(strict_cuda):
        model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4)).to("cuda:1")
        assert all(p.device == torch.device("cuda", 1) for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), foreach=True)  # foreach kernels: lists position by position
        tokens, targets = torch.tensor([[1, 2, 3]]).cuda(1), torch.tensor([0, 1, 2]).to("cuda:1")
        nn.functional.cross_entropy(model(tokens)[0], targets).backward()
        assert all(p.grad.device == p.device for p in model.parameters())
        optimizer.step()
        with pytest.raises(RuntimeError, match=MIXED):
            nn.functional.cross_entropy(model(tokens)[0], torch.tensor([0, 1, 2]))  # the targets left behind


def test_a_copys_gradient_goes_back_to_where_its_input_was(strict_cuda):
    # manual_dp's replicas are copies of the original parameters on the other devices: each replica's
    # gradient must reach the original on its own device (CUDA's ToCopyBackward), not stay where it arrived.
    with on_cpu(strict_cuda):
        original = torch.ones(3, device="cuda:0", requires_grad=True)
        (original.to("cuda:1") * torch.ones(3, device="cuda:1")).sum().backward()
        assert original.grad.device == original.device
        original.grad.add_(original)  # what an optimizer does with it


def test_threads_started_under_the_stand_in_run_under_it(strict_cuda):
    import threading

    seen = []

    def work():
        try:
            torch.ones(2, device="cuda:1") + torch.ones(2)
        except RuntimeError as e:
            seen.append(str(e))

    with on_cpu(strict_cuda):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    assert seen and MIXED in seen[0]


# ---- issue 45: context_parallel's slice of the batch


def test_a_gpu_index_into_the_cpu_batch_fails_under_the_stand_in_as_on_the_h100(strict_cuda):
    layout = Split("zigzag", 2, 16)
    with on_cpu(strict_cuda):
        batch = SyntheticData(WORKLOADS["transformer"], 0, 4).batch(0)  # made on the CPU, as the loop's are
        index = layout.positions(1)
        with pytest.raises(RuntimeError, match=INDEX):
            batch[0][:, index.to("cuda:0")]  # before 8140831: the index moved to the rank's GPU at set-up
        x = batch[0][:, index.to(batch[0].device)].to("cuda:0")  # now: on the batch's device, then moved
        assert x.device == torch.device("cuda", 0) and x.shape == (4, 8)


def _before_the_fix(t, batch):
    """context_parallel.local_loss before commit 8140831 ("slice the batch with an index on the batch's
    device"), whose install() had already moved the index to the rank's GPU."""
    s = t.state
    x, y = (b[:, s.index.to(t.device)].to(t.device, non_blocking=True) for b in batch)
    return t.loss_fn(t.model(x, positions=s.positions), y)


# ---- every strategy's step, with CUDA device objects, under the stand-in

# (strategy, workload, options) of the SPMD strategies that run on 2 ranks: the smallest model each trains
SPMD = [("manual_ddp", "cnn", {}), ("ddp", "cnn", {}), ("zero", "cnn", {"zero_stage": 2}),
        ("zero_optimizer", "cnn", {}), ("fsdp", "cnn", {}), ("manual_tp", "transformer", {}),
        ("tensor_parallel", "transformer", {}), ("pipeline_dist", "cnn", {}), ("context_parallel", "transformer", {}),
        ("fsdp_cp", "transformer", {}), ("ulysses", "transformer", {}), ("fsdp_ulysses", "transformer", {}),
        ("expert_parallel", "moe", {})]
FOUR = [("fsdp_tp", "transformer", {}), ("fsdp_pp", "cnn", {})]  # dp x tp, dp x pp: at least 4 ranks
# What cannot run under the stand-in, and why:
NOT_HERE = {
    "hogwild": "refused on GPUs by its validate (it shares CPU memory between processes): no GPU step exists",
    "torch_cp": "torch's context_parallel() picks its attention by the real device: on the CPU the flash kernel "
                "for CPU, which has no sharding rule (torch_cp.CPU_WHY), where a GPU would get CUDA's",
}


def _config(workload: str, world: int, options: dict) -> RunConfig:
    return RunConfig(workload=workload, devices="cuda:" + ",".join(map(str, range(world))), batch_size=8, steps=1,
                     warmup=0, extras=False, options=options, **({"seq_len": 16} if workload != "cnn" else {})
                     ).validate()


def _steps(rank, world, runs, before_the_fix: bool):
    """In each rank, the stand-in for `world` GPUs and one step of each run on cuda:rank: (name, final loss
    or the error it raised, whether it asked for its GPU); then, with before_the_fix, context_parallel as it
    was before 8140831."""
    import torch.distributed as td

    from parallel.worker import execute
    from parallel.world import devices

    cuda = StrictCuda(world)
    devices.CUDA = cuda  # this rank is a process of its own: nothing to put back
    # The GPUs stood for talk nccl; gloo only carries the stand-in's CPU tensors. base.full_state_dict reads
    # CUDA tensors over gloo as ranks sharing one GPU, and takes a path for them that real GPUs never take.
    td.get_backend = lambda group=None: "nccl"
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world, device=torch.device("cuda", rank))
    out = []
    for name, workload, options in runs + ([("context_parallel", "transformer", {})] if before_the_fix else []):
        if before_the_fix and len(out) == len(runs):
            context_parallel.local_loss = _before_the_fix
        cuda.log.clear()
        try:
            with on_cpu(cuda):
                loss = execute(strategies.get(name), _config(workload, world, options), dist)[0].final_loss
        except RuntimeError as e:
            loss = str(e)
        out.append((name, loss, ("to", rank) in cuda.log))
    return out


def test_every_spmd_strategy_steps_under_the_stand_in_and_context_parallel_before_its_fix_does_not():
    got = run_ranks(_steps, 2, (SPMD, True), timeout=60)
    for rank, results in enumerate(got):
        *now, before = results
        for (name, loss, asked), run in zip(now, SPMD, strict=True):
            assert name == run[0] and isinstance(loss, float) and math.isfinite(loss) and asked, (rank, name, loss)
        assert before[0] == "context_parallel" and "indices should be either on cpu" in before[1], before


def test_every_in_process_strategy_steps_under_the_stand_in(strict_cuda):
    from parallel.worker import execute

    names = [n for n in strategies.NAMES if strategies.get(n).launch == "inprocess"]
    for name in names:  # model_parallel's and pipeline's stages, manual_dp's replicas: a device each
        s = strategies.get(name)  # stages cut by parameters: the timed cut runs under the stand-in in test_gpu_paths
        options = {"balance": "params"} if "balance" in getattr(s.Options, "__dataclass_fields__", {}) else {}
        with on_cpu(strict_cuda):
            row, _ = execute(s, _config("cnn", 2, options), Dist(device=torch.device("cuda", 0)))
        assert math.isfinite(row.final_loss), name
    # data_parallel's nn.DataParallel passes through where torch.cuda.is_available() is False, as here: its
    # own kernels (broadcast_coalesced, scatter) are CUDA's, so only the model's step runs on cuda:0.
    ran = {*names, *(r[0] for r in SPMD + FOUR), *NOT_HERE}
    assert ran == set(strategies.NAMES), set(strategies.NAMES) ^ ran  # a new strategy is placed here


@pytest.mark.slow
def test_the_strategies_of_four_ranks_step_under_the_stand_in():
    for results in run_ranks(_steps, 4, (FOUR, False), timeout=120):
        for (name, loss, asked), run in zip(results, FOUR, strict=True):
            assert name == run[0] and isinstance(loss, float) and math.isfinite(loss) and asked, (name, loss)
