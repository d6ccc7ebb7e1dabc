"""fsdp_ulysses: Ulysses with FSDP2, the sequence ranks folded into the sharding group, as fsdp_cp does for the ring.

    torchrun --nproc_per_node=4 scripts/fsdp_ulysses.py --workload transformer --seq-len 256 [--ring 2] [--cp C]

The diff from `ulysses`: the weights are not replicated but sharded by FSDP2 over all N ranks, dp x cp of
them, as one group, for fsdp_cp's reason: every rank of a sequence group holds the same weights and needs
the same gradient sum, exactly what a dp rank needs. First ulysses.apply puts the all-to-all (and the ring,
--ring R) in every attention over mesh["cp"], then fsdp.apply shards every block and the root over
mesh["dp_shard", "cp"] flattened into one dimension:

    4 devices, --cp 4 --ring 2:   all-to-all: ranks 0 1, ranks 2 3   ring: ranks 0 2, ranks 1 3   FSDP2: 0 1 2 3
"""

from __future__ import annotations

from parallel.measure import context
from parallel.strategies.base import Hooks, Mutant, Trainable, full_state_dict, injected, model_state_every_rank
from parallel.strategies.composed.fsdp_cp import memory_layout  # FSDP2 over all dp x cp ranks: ZeRO-3's memory
from parallel.strategies.data import fsdp
from parallel.strategies.model import ulysses
from parallel.strategies.model.context_parallel import cp_of, local_loss
from parallel.strategies.model.ulysses import Options
from parallel.world.dims import ParallelDims

NAME = "fsdp_ulysses"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    mesh = dims(run).mesh(dist.device.type, keep=("dp_shard", "cp"))  # made once, dp 1 included (cp = N)
    model = model.to(dist.device)
    state = ulysses.apply(model, mesh["cp"], run, dist)
    shard = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # every rank of the run one FSDP2 group
    if injected(run, NODE_ONLY):  # the bug: over each all-to-all group alone (a node), as HSDP would, unreplicated
        shard = a2a_mesh(run, dist.device.type)
    fsdp.apply(model, shard, reshard=None)  # torch's default: the root kept for backward
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state)


def train_step(t: Trainable, batch, dist):
    t.optimizer.zero_grad(set_to_none=True)
    loss = local_loss(t, batch)
    loss.backward()  # the all-to-alls' gradients home; FSDP2 reduce-scatters the weights', averaged over dp x cp
    t.optimizer.step()
    return loss.detach()


__all__ = ["Options"]  # the same knobs as ulysses (--ring, --cp, --cp-layout, --cp-comm)

DEFAULT_CP = 0  # every rank splits the sequence (--cp 2 on 4 devices: dp 2 x cp 2)


def check(run) -> None:
    ulysses.check(run)


NODE_ONLY = Mutant("fsdp_ulysses:shard-over-a2a-only", "FSDP2 over each all-to-all group alone (the fast links of "
                   "a node), not every rank: the gradients are never summed across the ring",
                   {"workload": "transformer", "devices": "cpu:4", "options": {"ring": 2}})
MUTANTS = (NODE_ONLY,)


def a2a_mesh(run, device_type: str):
    """NODE_ONLY's group: this rank's all-to-all ranks, the innermost slice of a dp x ring x a2a mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    cp, ring = cp_of(run, DEFAULT_CP), run.options.ring
    shape = (run.world_size // cp, ring, cp // ring)
    return init_device_mesh(device_type, shape, mesh_dim_names=("dp", "ring", "a2a"))["a2a"]


def dims(run, dist=None) -> ParallelDims:
    """dp x cp, cp innermost: each dp coordinate a sequence group (all-to-all, ring), FSDP2 over all of them."""
    cp = cp_of(run, DEFAULT_CP)
    return ParallelDims(world=run.world_size, dp_shard=run.world_size // cp, cp=cp)


SEQUENCE = True

MEASURE = context.Context(dims, local_loss, fsdp_blocks=fsdp.blocks, attention_bytes=context.a2a_bytes_predicted)

HOOKS = Hooks(dims=dims, check=check, state_dict=full_state_dict, model_state_bytes=model_state_every_rank,
              memory_layout=memory_layout)
