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
full all-reduce stays. Its overlap with DDP (`overlap_with_ddp=True`) refuses gloo (pytorch#62300). Both
are counted at the collectives (the loop's wire.Counter); DDP's all-reduce goes through a comm hook (torch's own
allreduce_hook) so that it passes the dispatcher where the counter sees it.
"""

from __future__ import annotations

import torch
import torch.distributed as td
from torch.autograd.profiler import record_function
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.kit.tensors import tensor_bytes
from parallel.loop import master, optim
from parallel.measure import sharded
from parallel.measure.formulas import optimizer_bytes
from parallel.models.outputs import call
from parallel.strategies.base import Hooks, Mutant, Trainable, injected, loaded_in_place

NAME = "zero_optimizer"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    # Imported here: torch.distributed.optim scripts its functional optimizers with TorchScript at import,
    # about 1.2 s, which every process that lists the strategies would otherwise pay.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    model = model.to(dist.device)
    ddp = DDP(model, device_ids=[dist.device] if dist.device.type == "cuda" else None, gradient_as_bucket_view=True)
    # the run's optimiser (loop/optim.Recipe): its class, settings and weight-decay groups, each rank's share
    optimizer = ZeroRedundancyOptimizer(make_optimizer.groups(ddp.parameters()), optimizer_class=make_optimizer.cls,
                                        **make_optimizer.defaults)
    t = Trainable(ddp, optimizer, loss_fn, dist.device)
    ddp.register_comm_hook(t, _labelled_allreduce)
    return t


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()  # DDP's all-reduce, bucket by bucket
    with record_function("step owned parameters, broadcast them"):
        (t.optimizer.optim if injected(t, LOCAL_STEP_ONLY) else t.optimizer).step()
    return loss.detach()


def _labelled_allreduce(t: Trainable, bucket):  # no return annotation: DDP rejects a string one
    with record_function(f"all-reduce bucket {bucket.index()}"):
        return default_hooks.allreduce_hook(None, bucket)


def check(run) -> None:
    run.check_divisible(run.world_size, "world size")


# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
LOCAL_STEP_ONLY = Mutant("zero_optimizer:local-step-only", "the wrapped optimizer's own step() called instead of "
                         "ZeroRedundancyOptimizer's: the parameters are never broadcast back", {"workload": "cnn"})
MUTANTS = (LOCAL_STEP_ONLY,)


def _owned(t: Trainable, rank: int) -> list[torch.nn.Parameter]:
    return [p for group in t.optimizer._partition_parameters()[rank] for p in group["params"]]


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """The model's state; under bf16-master each parameter's fp32 master (loop/master.py), which only its
    owner keeps, broadcast from it."""
    state = {k: v.detach().cpu().clone() for k, v in t.model.module.state_dict().items()}
    if not master.masters(t.optimizer):
        return state
    names = {p: n for n, p in t.model.module.named_parameters()}
    for rank in range(td.get_world_size()):
        for p in _owned(t, rank):  # the owner's p holds its master while the state is read (master.published)
            held = p.detach() if rank == td.get_rank() else torch.empty(p.shape, dtype=torch.float32, device=p.device)
            td.broadcast(held, src=rank)
            state[names[p]] = held.cpu().clone()
    return state


def model_state_bytes(t: Trainable, run) -> list[int]:
    """Every rank: all parameters and gradients; optimizer state for the parameters it owns."""
    full = sum(2 * tensor_bytes(p) for p in t.model.parameters())  # parameter + its gradient
    return [full + sum(optimizer_bytes(run.precision, optim.moments(run, [p])) * p.numel() for p in _owned(t, r))
            for r in range(run.world_size)]  # + its state (bf16-master: its fp32 master too)


def checkpoint_state(t: Trainable) -> dict:
    """The parameters under the model's names (DCP writes them once) and the momentum of each parameter
    under its own name, written by the rank that owns it; a resume needs the same N (the same owners)."""
    names = {p: n for n, p in t.model.module.named_parameters()}
    momenta = {f"{key}.{names[p]}": v for p in _owned(t, td.get_rank())
               for key, v in optim.state_now(t.optimizer.optim, p).items()}  # momentum, or AdamW's moments
    return {"model": t.model.module.state_dict(), **momenta, "step": torch.zeros((), dtype=torch.int64)}


def memory_layout(run, layout):
    return layout.replace(zero_stage=1)  # the optimizer state sharded (the planner's memory)


# Its measurement (parallel/measure/sharded.py): what each rank holds beside ZeRO-1's formula, the parameters
# each owns, the textbook's bytes (3 Psi) and the cost model's step.
MEASURE = sharded.ZeroRedundancy(owned=_owned)

HOOKS = Hooks(check=check, state_dict=state_dict, model_state_bytes=model_state_bytes,
              checkpoint_state=checkpoint_state, restore_checkpoint=loaded_in_place, memory_layout=memory_layout)
