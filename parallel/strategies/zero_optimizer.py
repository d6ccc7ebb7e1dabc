"""zero_optimizer: torch's ZeroRedundancyOptimizer with DDP, the library's ZeRO-1 beside `zero`.

    torchrun --nproc_per_node=2 scripts/zero_optimizer.py

The diff from `ddp`: the optimizer is wrapped in ZeroRedundancyOptimizer (torch.distributed.optim), which
gives each rank whole parameters to own, assigned greedily by size, largest first (so the shares are
uneven), and keeps optimizer state for those only. What it does each step, read in torch 2.13's source:

    backward          DDP all-reduces every gradient, as always          2(N-1)/N x P bytes a rank sends
    optimizer.step()  each rank steps the parameters it owns
    _sync_params      every rank broadcasts its parameters to the others, one broadcast per parameter
                                                                          (N-1)/N x P more

About 3 P in all where the ZeRO paper's stage 1 needs 2 P (reduce-scatter + all-gather, `zero`): DDP's
full all-reduce stays. Its overlap with DDP (`overlap_with_ddp=True`) refuses gloo (pytorch#62300). The
broadcasts are counted by intercepting torch.distributed.broadcast during the step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch.autograd.profiler import record_function
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.strategies.base import (
    Hooks,
    Mutant,
    Trainable,
    injected,
    loaded_in_place,
    optimizer_state_bytes,
    ring_allreduce_bytes,
    tensor_bytes,
)

NAME = "zero_optimizer"
LAUNCH = "torchrun"
SYNCHRONOUS = True

# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
LOCAL_STEP_ONLY = Mutant("zero_optimizer:local-step-only", "the wrapped optimizer's own step() called instead of "
                         "ZeroRedundancyOptimizer's: the parameters are never broadcast back", {"workload": "cnn"})
MUTANTS = (LOCAL_STEP_ONLY,)


@dataclass
class Sent:
    """Bytes this rank sent, by collective, counted where they happen."""

    world: int
    by_kind: dict[str, float] = field(default_factory=lambda: {"all_reduce": 0.0, "broadcast": 0.0})


def check(config) -> None:
    config.check_divisible(config.world_size, "world size")


def _counting_allreduce(t: Trainable, bucket):  # no return annotation: DDP rejects a string one
    buf = bucket.buffer()
    t.state.by_kind["all_reduce"] += ring_allreduce_bytes(buf.numel() * buf.element_size(), t.state.world)
    with record_function(f"all-reduce bucket {bucket.index()}"):
        return default_hooks.allreduce_hook(None, bucket)


@contextlib.contextmanager
def _counting_broadcasts(sent: Sent):
    """torch.distributed.broadcast, counted while ZeroRedundancyOptimizer syncs the parameters. A
    broadcast of b bytes over a ring (pipelined) has N-1 links each carry b: (N-1)/N x b per rank."""
    real = td.broadcast

    def counted(tensor, *args, **kwargs):
        sent.by_kind["broadcast"] += (sent.world - 1) / sent.world * tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    td.broadcast = counted  # the optimizer calls torch.distributed.broadcast through the module: seen here
    try:
        yield
    finally:
        td.broadcast = real


def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable:
    # Imported here: torch.distributed.optim scripts its functional optimizers with TorchScript at import,
    # about 1.2 s, which every process that lists the strategies would otherwise pay.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = model.to(dist.device)
    ddp = DDP(model, device_ids=[dist.device] if dist.device.type == "cuda" else None, gradient_as_bucket_view=True)
    like = make_optimizer([torch.zeros(1, requires_grad=True)])  # the run's optimizer: its class and settings
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=type(like), **like.defaults)
    t = Trainable(ddp, optimizer, loss_fn, dist.device, comm_bytes=0, state=Sent(dist.world_size))
    ddp.register_comm_hook(t, _counting_allreduce)
    return t


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(t.model(x), y)
    loss.backward()  # DDP's all-reduce, bucket by bucket
    with record_function("step owned parameters, broadcast them"), _counting_broadcasts(t.state):
        (t.optimizer.optim if injected(t, LOCAL_STEP_ONLY) else t.optimizer).step()
    t.comm_bytes = sum(t.state.by_kind.values())
    return loss.detach()


def _owned(t: Trainable, rank: int) -> list[torch.nn.Parameter]:
    return [p for group in t.optimizer._partition_parameters()[rank] for p in group["params"]]


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in t.model.module.state_dict().items()}


def model_state_bytes(t: Trainable, config) -> list[int]:
    """Every rank: all parameters and gradients; optimizer state for the parameters it owns."""
    full = sum(2 * tensor_bytes(p) for p in t.model.parameters())  # parameter + its gradient
    return [full + sum(tensor_bytes(p) for p in _owned(t, r)) for r in range(config.world_size)]  # + momentum


def comm_bytes_predicted(model, config) -> float:
    """DDP's all-reduce (2(N-1)/N x P) + the parameters broadcast from their owners ((N-1)/N x P)."""
    n, p = config.world_size, sum(tensor_bytes(q) for q in model.parameters())
    return 3 * (n - 1) / n * p


def extra_measurements(t: Trainable, data, config, dist, result) -> dict:
    steps = max(1, len(result.losses))
    owned = [sum(tensor_bytes(p) for p in _owned(t, r)) for r in range(config.world_size)]
    return {"bytes_per_step_by_collective": {k: v / steps for k, v in t.state.by_kind.items()},
            "owned_param_bytes_per_rank": owned,  # greedy by size: uneven
            "optimizer_state_bytes_per_rank": [optimizer_state_bytes(_owned(t, r), t.optimizer.optim)
                                               if r == dist.rank else None for r in range(config.world_size)]}


def checkpoint_state(t: Trainable) -> dict:
    """The parameters under the model's names (DCP writes them once) and the momentum of each parameter
    under its own name, written by the rank that owns it; a resume needs the same N (the same owners)."""
    names = {p: n for n, p in t.model.module.named_parameters()}
    own = t.optimizer.optim.state
    momenta = {}
    for p in _owned(t, td.get_rank()):
        own[p].setdefault("momentum_buffer", torch.zeros_like(p))  # SGD makes it at the first step
        momenta[f"momentum.{names[p]}"] = own[p]["momentum_buffer"]
    return {"model": t.model.module.state_dict(), **momenta, "step": torch.zeros((), dtype=torch.int64)}


HOOKS = Hooks(check=check, state_dict=state_dict, model_state_bytes=model_state_bytes,
              comm_bytes_predicted=comm_bytes_predicted, extra_measurements=extra_measurements,
              checkpoint_state=checkpoint_state, restore_checkpoint=loaded_in_place)
