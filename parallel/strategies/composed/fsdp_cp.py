"""fsdp_cp: context parallelism with FSDP2, the cp ranks folded into the sharding group (torchtitan's way).

    torchrun --nproc_per_node=4 scripts/fsdp_cp.py --workload transformer --seq-len 256 [--cp 2]

The diff from `context_parallel`: the weights are not replicated but sharded by FSDP2 over all N ranks,
dp x cp of them, as one group (torchtitan's "dp_shard_cp" mesh dimension). Why one group and not FSDP
over dp alone: every cp rank holds the same weights and needs the same gradient sum, exactly what a dp
rank needs, so sharding over all N divides the model state by N instead of N / cp, and the one
reduce-scatter sums the gradients over cp and dp at once (a separate all-reduce over cp would add a
collective a step). A composition on one dp x cp mesh, as torchtitan's parallelize does: first
context_parallel.apply puts the ring in every attention over mesh["cp"], then fsdp.apply shards every block
and the root over mesh["dp_shard", "cp"] flattened into one dimension:

    4 devices, --cp 2:   dp 0: ranks 0 1 (a ring)    dp 1: ranks 2 3 (a ring)    FSDP2: ranks 0 1 2 3
"""

from __future__ import annotations

from parallel.measure import context
from parallel.strategies.base import Hooks, Mutant, Trainable, full_state_dict, injected, model_state_every_rank
from parallel.strategies.data import fsdp
from parallel.strategies.model import context_parallel
from parallel.strategies.model.context_parallel import Options, check_cp, cp_of
from parallel.world.dims import ParallelDims

NAME = "fsdp_cp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    mesh = dims(run).mesh(dist.device.type, keep=("dp_shard", "cp"))  # made once, dp 1 included (cp = N)
    model = model.to(dist.device)
    state = context_parallel.apply(model, mesh["cp"], run, dist)
    # torchtitan's "dp_shard_cp": every rank of the run one FSDP2 group; the bug: over the dp ranks alone
    shard = mesh["dp_shard"] if injected(run, DP_ONLY) else mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    fsdp.apply(model, shard, reshard=None)  # torch's default: the root kept for backward
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state)


def train_step(t: Trainable, batch, dist):
    t.optimizer.zero_grad(set_to_none=True)
    loss = context_parallel.local_loss(t, batch)
    loss.backward()  # the ring's dK,dV home; FSDP2 reduce-scatters the gradients, averaged over dp x cp
    t.optimizer.step()
    return loss.detach()


__all__ = ["Options"]  # the same knobs as context_parallel (--cp-layout, --cp-comm, --cp)

DEFAULT_CP = 2  # on 4 devices: dp 2 x cp 2


def check(run) -> None:
    check_cp(run, cp_of(run, DEFAULT_CP))


DP_ONLY = Mutant("fsdp_cp:shard-over-dp-only", "FSDP2 over the dp ranks alone, as for plain data parallelism: "
                 "the gradients are never summed over the cp ranks", {"workload": "transformer"})
MUTANTS = (DP_ONLY,)


def dims(run, dist=None) -> ParallelDims:
    """dp x cp, cp innermost: each dp coordinate a ring of cp ranks, and FSDP2 over all of them."""
    cp = cp_of(run, DEFAULT_CP)
    return ParallelDims(world=run.world_size, dp_shard=run.world_size // cp, cp=cp)


def memory_layout(run, layout):
    return layout.replace(zero_stage=3)  # FSDP2 over all dp x cp ranks (the planner's memory)


SEQUENCE = True

MEASURE = context.Context(dims, context_parallel.local_loss, fsdp_blocks=fsdp.blocks)  # measure/context.py

HOOKS = Hooks(dims=dims, check=check, state_dict=full_state_dict, model_state_bytes=model_state_every_rank,
              memory_layout=memory_layout)
