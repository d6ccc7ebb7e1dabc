"""ulysses: every sequence split between ranks, attention by all-to-all over the heads (DeepSpeed-Ulysses).

    torchrun --nproc_per_node=2 scripts/ulysses.py --workload transformer --seq-len 256 [--ring R] [--cp C]

The diff from `context_parallel`: the same slices of every sequence, the same loss over a rank's slice
and the same average of the gradients over every rank; only attention differs. Instead of passing K,V
around a ring, an all-to-all turns this rank's positions of every head into every position of H/U of the
heads, ordinary causal attention runs on them, and a second all-to-all turns the output back
(kit/ulysses.py). It sends less than the ring (bytes per rank fall as 1/U) but splits the heads, so U
is bounded by them:

    rank 0 (positions 0-7, heads 0-3)  -> a2a ->  heads 0-1, positions 0-15  -> attention -> a2a -> back
    rank 1 (positions 8-15, heads 0-3) -> a2a ->  heads 2-3, positions 0-15  -> attention -> a2a -> back

--ring R (USP's hybrid) makes each group of C ranks U = C / R all-to-all neighbours times R of them, and
attention inside the all-to-all is the ring's (kit/ring_attention.py, --cp-layout and --cp-comm as for
context_parallel) across the R: rank c holds the (c % U)-th part of the positions its ring rank c // U
holds. On GPUs the all-to-all stays inside a node and the ring crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as td

from parallel.kit.ulysses import heads_problem, placed
from parallel.measure import context
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.strategies.model import context_parallel
from parallel.strategies.model.context_parallel import State, average_gradients, check_cp, cp_of, local_loss
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "ulysses"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    model = model.to(dist.device)
    state = apply(model, dims(run).mesh(dist.device.type, keep=("cp",))["cp"], run, dist)
    for p in model.parameters():  # every rank starts from rank 0's weights (they are built alike anyway)
        td.broadcast(p.detach(), src=0)
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state)


def train_step(t: Trainable, batch, dist):
    t.optimizer.zero_grad(set_to_none=True)
    loss = local_loss(t, batch)  # this rank's slice of every sequence, as context_parallel's
    loss.backward()  # each all-to-all's backward is the reverse all-to-all: every gradient goes home
    average_gradients(list(t.model.parameters()), t.state.world)
    t.optimizer.step()
    return loss.detach()


def apply(model, mesh, run, dist) -> State:
    """Put this rank's all-to-all attention (with the ring inside it, --ring R > 1) in every attention
    layer of `model`, its sequence group being `mesh` (a mesh's slice "cp"); what a step needs to slice."""
    o = run.options
    attend, positions = placed(dist.world_size, mesh.size(), o.ring, o.cp_layout, run.workload.input_shape[0],
                               mesh.get_local_rank(), timedelta(seconds=run.pg_timeout), o.cp_comm)
    if injected(run, HEADS_ROTATED):
        attend.heads_back = heads_rank_minor
    for attention in model.attentions():
        attention.attend = attend
    return State(positions, positions.to(dist.device), dist.world_size)


@dataclass
class Options(context_parallel.Options):
    ring: int = field(default=1, metadata={"help": "ranks of each sequence group joined by a ring inside the "
                                                   "all-to-all (USP's hybrid; 1: all-to-all alone)"})

    def __post_init__(self):
        super().__post_init__()
        if self.ring < 1:
            raise ConfigError(f"--ring must be 1 (the default) or more, got {self.ring}")


def check(run) -> None:
    o, cp, seq = run.options, cp_of(run), run.workload.input_shape[0]
    if cp % o.ring or cp == o.ring > 1:
        also = f" (--ring {cp}: that is context_parallel)" if cp > 1 else ""
        raise ConfigError(f"--ring {o.ring} must divide the {cp} ranks of a sequence group and leave an "
                          f"all-to-all of two or more{also}")
    check_cp(run, cp, o.ring)
    if seq % cp:
        raise ConfigError(f"--seq-len {seq} is not divisible by the {cp} ranks that split it")
    a = run.meta_model.attentions()[0]
    if why := heads_problem(a.q.out_features // a.head_size, a.k.out_features // a.head_size, cp // o.ring):
        raise ConfigError(f"{why} (--ring R passes K,V around a ring of R groups instead)")


def dims(run, dist=None) -> ParallelDims:
    cp = cp_of(run)
    return ParallelDims(world=run.world_size, dp_replicate=run.world_size // cp, cp=cp)


HEADS_ROTATED = Mutant("ulysses:heads-rank-minor", "the all-to-all back lays the heads out rank-minor (head j of "
                       "rank r at j U + r, not r H/U + j): the output projection reads them permuted",
                       {"workload": "transformer"})
MUTANTS = (HEADS_ROTATED,)


def heads_rank_minor(got):
    """HEADS_ROTATED: Ulysses.heads_back with the rank and head axes read the other way round."""
    u, b, h, length, d = got.shape
    return got.permute(1, 2, 0, 3, 4).reshape(b, u * h, length, d)


LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)
SEQUENCE = True  # it replaces the model's attention (model.attentions())

MEASURE = context.Context(dims, local_loss, attention_bytes=context.a2a_bytes_predicted)  # measure/context.py

HOOKS = Hooks(dims=dims, check=check)
