"""context_parallel: every sequence split between ranks, attention by a ring of K,V blocks (by hand).

    torchrun --nproc_per_node=2 scripts/context_parallel.py --workload transformer --seq-len 256 \\
        [--cp-layout contiguous|zigzag] [--cp-comm ring|allgather] [--cp C]

The diff from `single`: each of the C ranks of a context-parallel group keeps its slice of every sequence
of its share of the batch (the same share for the whole group; dp = N / C groups take a share each), and
feeds the model that slice with the slice's global positions (the position embedding and the causal
mask need them). Everything but attention is per token, so it runs on the slice unchanged; attention
needs every earlier token's K,V, which `ring_attention` brings around the group:

    rank 0 (positions 0-7)   q0 . [K,V]0  ->  q0 . [K,V]1 (masked: all later)
    rank 1 (positions 8-15)  q1 . [K,V]1  ->  q1 . [K,V]0 (all earlier)          merged by log-sum-exp

Each rank's loss is the mean over its own tokens, an equal share, so the mean of the ranks' losses is
`single`'s loss over the whole batch. The weights are replicated: after backward the gradients are
averaged over all N ranks (dp x cp) in one flat all-reduce, as the anchors do (torchtitan folds cp into
the data-parallel group of FSDP: `fsdp_cp`). --cp-layout zigzag (the default) gives rank r chunks r and
2C-1-r, which balances the causal work; contiguous gives the last rank the most.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn

from parallel.kit.collectives import sum_gradients
from parallel.kit.ring_attention import COMMS, SPLITS, Ring, Split, split_check
from parallel.loop.tokens import own_mean
from parallel.measure import context
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.world.devices import SHARED_GLOO_NO_P2P
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "context_parallel"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    model = model.to(dist.device)
    state = apply(model, dims(run, dist).mesh(dist.device.type, keep=("cp",))["cp"], run, dist)
    for p in model.parameters():  # every rank starts from rank 0's weights (they are built alike anyway)
        td.broadcast(p.detach(), src=0)
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state)


def train_step(t: Trainable, batch, dist):
    s = t.state
    t.optimizer.zero_grad(set_to_none=True)
    loss = local_loss(t, batch)
    loss.backward()  # ring attention's backward carries every block's dK,dV back to its owner
    average_gradients(list(t.model.parameters()), s.world)
    t.optimizer.step()
    return loss.detach()


@dataclass
class State:
    index: torch.Tensor  # which positions of a sequence this rank keeps: on the CPU, where batches are made
    positions: torch.Tensor  # the global positions it gives the model (the same, but for a bug)
    world: int


def apply(model: nn.Module, mesh, run, dist) -> State:
    """Put this rank's ring attention over `mesh` (its context-parallel ranks: a mesh's slice "cp") in every
    attention layer of `model`; what a step needs to slice."""
    o = run.options
    seq, cp, cp_rank = run.workload.input_shape[0], mesh.size(), mesh.get_local_rank()
    layout = Split(o.cp_layout, cp, seq)
    seen = Split("contiguous", cp, seq) if injected(run, ZIGZAG_UNPERMUTED) else layout
    ring = Ring(mesh.get_group(), seen, o.cp_comm)
    if injected(run, LSE_SWAPPED):
        ring.merge = merge_swapped
    if injected(run, LOCAL_MASK):
        ring.mask = mask_by_local_offsets
    if injected(run, NOT_DIFFERENTIABLE):
        ring.home = torch.zeros_like  # the last hop home never made: nothing arrives
    for attention in model.attentions():
        attention.attend = ring  # one ring for every layer: its group, and the positions it masks by
    return State(layout.positions(cp_rank), seen.positions(cp_rank).to(dist.device), dist.world_size)


def local_loss(t: Trainable, batch):
    """The mean loss over this rank's slice of every sequence of its share of the batch."""
    s = t.state
    x, y = (b[:, s.index.to(b.device)].to(t.device, non_blocking=True) for b in batch)  # (B/dp, T/cp) each
    loss_fn = own_mean(t.loss_fn) if injected(t, SHARD_MEAN) else t.loss_fn
    return loss_fn(t.model(x, positions=s.positions), y)


def average_gradients(params: list[nn.Parameter], world: int) -> None:
    """Every gradient averaged over the world, in one flat all-reduce (the sum over dp x cp: each rank's
    gradient is of its own tokens' mean)."""
    sum_gradients(params, world)


_ZIGZAG = {"workload": "transformer", "options": {"cp_layout": "zigzag"}}


@dataclass
class Options:
    cp_layout: str = field(default="zigzag", metadata={"help": "which positions a rank holds: contiguous, or "
                                                               "zigzag (chunks r and 2C-1-r: balanced)"})
    cp_comm: str = field(default="ring", metadata={"help": "ring (K,V passed rank to rank) or allgather (K,V "
                                                           "all-gathered, dK,dV reduce-scattered)"})
    cp: int = field(default=0, metadata={"help": "ranks per context-parallel group; the rest data parallel "
                                                 "(0: context_parallel every rank, fsdp_cp 2)"})

    def __post_init__(self):
        if self.cp_layout not in SPLITS:
            raise ConfigError(f"--cp-layout must be one of {', '.join(SPLITS)}, got {self.cp_layout!r}")
        if self.cp_comm not in COMMS:
            raise ConfigError(f"--cp-comm must be one of {', '.join(COMMS)}, got {self.cp_comm!r}")
        if self.cp < 0:
            raise ConfigError(f"--cp must be 0 (the default) or more, got {self.cp}")


def cp_of(run, default: int = 0) -> int:
    """The ranks per context-parallel group: --cp, or `default` (0: every rank)."""
    return run.options.cp or default or run.world_size


def check_cp(run, cp: int, ring: int = 0) -> None:
    """What every context-parallel strategy needs of a run, with `cp` ranks per group, `ring` of them (0:
    all) passing K,V around a ring (ulysses: the rest by all-to-all)."""
    o, n, ring = run.options, run.world_size, ring or cp
    if n % cp:
        raise ConfigError(f"--cp {cp} does not divide the {n} devices")
    if cp == 1 and n > 1:
        raise ConfigError("--cp 1 splits no sequence: that is data parallel (manual_ddp, ddp)")
    run.check_divisible(n // cp, "data-parallel groups")
    if why := split_check(o.cp_layout if ring > 1 or ring == cp else "contiguous", ring, run.workload.input_shape[0]):
        raise ConfigError(why)
    if o.cp_comm == "ring" and ring > 1 and run.spec.shared:
        raise ConfigError(f"--cp-comm ring: {SHARED_GLOO_NO_P2P}; --cp-comm allgather runs there")


def check(run) -> None:
    check_cp(run, cp_of(run))


NOT_DIFFERENTIABLE = Mutant("context_parallel:rotation-not-differentiable", "K,V passed around the ring by "
                            "isend/irecv with autograd through the local merge only: dK,dV never go back to "
                            "their owner", {"workload": "transformer", "options": {"cp_layout": "contiguous"}})
ZIGZAG_UNPERMUTED = Mutant("context_parallel:zigzag-positions-unpermuted", "tokens sliced zig-zag, but positions "
                           "(embedding and mask) taken as if contiguous", _ZIGZAG)
LSE_SWAPPED = Mutant("context_parallel:lse-weights-swapped", "the online softmax merges two partial results "
                     "with each other's weight", _ZIGZAG)
LOCAL_MASK = Mutant("context_parallel:local-causal-mask", "the causal mask built from positions within the "
                    "rank's slice, not the global ones", _ZIGZAG)
SHARD_MEAN = Mutant("context_parallel:shard-mean", "uneven tokens: each rank's loss the mean over the real tokens of "
                    "its shard of the sequences; padding at the end leaves the last shards few (docs/loss.md)",
                    {"workload": "transformer", "tokens": "padded", "options": {"cp_layout": "contiguous"}})
MUTANTS = (NOT_DIFFERENTIABLE, ZIGZAG_UNPERMUTED, LSE_SWAPPED, LOCAL_MASK, SHARD_MEAN)


# How the injected bugs above are written: apply puts one in the ring's place


def merge_swapped(out, lse, out_b, lse_b):
    """LSE_SWAPPED: Ring.merge with each partial result weighted by the other's share."""
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse_b - new).unsqueeze(-1) + out_b * torch.exp(lse - new).unsqueeze(-1), new


def mask_by_local_offsets(qi, qs, ki, ks):
    """LOCAL_MASK: Ring.mask by the offsets within the rank's slice (qi, ki), not the global positions."""
    return torch.arange(ki.start, ki.stop)[None, :] > torch.arange(qi.start, qi.stop)[:, None]


def dims(run, dist=None) -> ParallelDims:
    cp = cp_of(run)
    return ParallelDims(world=run.world_size, dp_replicate=run.world_size // cp, cp=cp)


LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)
SEQUENCE = True  # it replaces the model's attention (model.attentions())

MEASURE = context.Context(dims, local_loss)  # parallel/measure/context.py: bytes, causal pairs, activations

HOOKS = Hooks(dims=dims, check=check)
