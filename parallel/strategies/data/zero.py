"""zero: ZeRO-1 and ZeRO-2 by hand (Rajbhandari et al., SC 2020): data parallel with the optimizer state sharded.

    torchrun --nproc_per_node=2 scripts/zero.py [--zero-stage 1|2]

The diff from `manual_ddp`: every rank still holds all the parameters and trains on its 1/N share of the
batch, and backward still hands the gradients over bucket by bucket as they land, but each bucket is cut
into N equal chunks, and rank r owns chunk r of every bucket: only those chunks' optimizer state (AdamW's
moments, SGD's momentum), and at stage 2 only their gradients. Each of the optimiser's groups (what
decays, what does not, and under Muon its matrices) is bucketed apart, so that a chunk is of one kind.
Muon needs whole matrices: a matrix bucket's bf16 updates are all-gathered (2 (N-1)/N bytes an element),
and each rank orthogonalises the matrices its chunk touches (loop/muon.Chunk).

    flat parameters, bucket by bucket, each padded to a multiple of N:
        [ bucket 0: r0 | r1 | ... ][ bucket 1: r0 | r1 | ... ] ...     (buckets in backward order)
    backward          as a bucket's last gradient lands: reduce-scatter it; rank r receives the SUM of
                      everyone's gradient for its chunk; / N = the mean
    optimizer.step()  torch's own update rule on this rank's chunks (a view of the parameters each)
    all-gather        every bucket's chunks into every rank's parameters

    stage 1: the full gradient buffer stays allocated (as DDP's buckets); stage 2 keeps a bucket's
             gradients only until its reduce-scatter, so at rest a rank holds 1/N of the gradients, and
             during backward one bucket of whole gradients at a time.

Bytes a rank sends per step: reduce-scatter (N-1)/N x P + all-gather (N-1)/N x P = 2(N-1)/N x P, the
same as DDP's one all-reduce (the paper's 2 Psi), for 1/N of the optimizer state (and at stage 2 of the
gradients); counted at the collectives (the loop's wire.Counter). The reduce-scatters block inside backward: on
CPU there is nothing to overlap with (the ranks' threads use every core); on GPUs, overlapping them
(async, a bounded number in flight) would hide them behind backward as DDP does. Not done here.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn
from torch.autograd.profiler import record_function

from parallel.kit.collectives import all_gather, reduce_scatter
from parallel.kit.tensors import optimizer_state_bytes, param_bytes, tensor_bytes
from parallel.loop import master, muon, optim
from parallel.measure import sharded
from parallel.models.outputs import call
from parallel.strategies.base import ADAMW, Hooks, Mutant, Trainable, injected, loaded_in_place
from parallel.strategies.data.manual_ddp import DEFAULT_BUCKET_MB, buckets_in_backward_order
from parallel.world.errors import ConfigError

NAME = "zero"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    o, n = run.options, dist.world_size
    model = model.to(dist.device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # every rank starts from rank 0's weights, sent before they are flattened (as DeepSpeed's
        td.broadcast(p.detach(), src=0)  # engine does before its ZeRO optimizer pads them): the layout is local
    # Each of the optimiser's groups (Muon's matrices, what decays, what does not) in buckets of its own, so
    # that a chunk holds one kind (loop/optim.py)
    groups = [g for part in ("muon", "decay", "no-decay") for g in buckets_in_backward_order(
        [p for p in params if make_optimizer.part(p) == part], (o.bucket_mb or DEFAULT_BUCKET_MB) * 2**20) if g]
    sizes = [math.ceil(sum(p.numel() for p in g) / n) * n for g in groups]  # each bucket padded to N chunks
    if injected(run, UNEVEN_PADDING) and dist.rank == BUG_RANK:
        sizes = [(sum(p.numel() for p in g) // n + 1) * n for g in groups]
    flat = torch.zeros(sum(sizes), dtype=params[0].dtype, device=dist.device)
    grads = torch.zeros_like(flat) if o.zero_stage == 1 else None
    owner = (dist.rank + 1) % n if injected(run, WRONG_SLICE) else dist.rank
    buckets, offsets, start = [], {}, 0
    for i, (group, size) in enumerate(zip(groups, sizes, strict=True)):
        offset = start
        for p in group:  # each parameter becomes a view of the flat buffer (its gradient, at stage 1, too)
            flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = flat[offset:offset + p.numel()].view_as(p)
            if grads is not None:
                p.grad = grads[offset:offset + p.numel()].view_as(p)
            offsets[p] = offset
            offset += p.numel()
        chunk = size // n  # a view: stepping it moves the model's weights
        shard = optim.like(nn.Parameter(flat[start + owner * chunk:][:chunk]), group[0])  # its bucket's kind
        if make_optimizer.part(shard) == "muon":  # Muon orthogonalises whole matrices: the bucket's, gathered
            setattr(shard, muon.WHOLE, muon.Chunk([(offsets[p] - start, p.shape) for p in group], owner * chunk,
                                                  chunk, n))
        buckets.append(Bucket(i, start, start + size, group, shard))
        start += size
    z = Shards(n, o.zero_stage, flat, grads, buckets, offsets,
               injected(run, BUCKET_EARLY))
    for b in buckets:
        for p in b.params:
            p.register_post_accumulate_grad_hook(functools.partial(_landed, z, b))
    optimizer = make_optimizer(z.shards)
    if injected(run, BF16_MASTER):
        optimizer.keep_in_bf16()
    return Trainable(model, optimizer, loss_fn, dist.device, state=z)


def train_step(t: Trainable, batch, dist):
    z = t.state
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    if z.grads is not None:
        z.grads.zero_()  # the parameters' .grad are views of it: zeroed in place, never set to None
    loss = t.loss_fn(call(t.model, x, y), y)  # the mean over this rank's share
    loss.backward()  # the hooks reduce-scatter each bucket as its last gradient lands
    for b in z.buckets:  # one whose parameters got no gradient is reduced now: every rank runs the same
        if not b.reduced:
            _reduce(z, b)
    t.optimizer.step()  # torch's update rule, on this rank's chunks only (in place: the model's weights)
    for b in z.buckets:
        b.shard.grad, b.ready, b.reduced = None, 0, False  # stage 1's gradients live in the buffer
        if not injected(t, NO_ALL_GATHER):
            with record_function(f"all-gather bucket {b.index}"):  # every rank's chunks into its weights
                all_gather(z.flat[b.start:b.end], b.shard.detach().clone())
    return loss.detach()


@dataclass
class Bucket:
    """A range of the flat parameters (its length a multiple of N) and this rank's chunk of it."""

    index: int
    start: int
    end: int
    params: list[nn.Parameter]
    shard: nn.Parameter  # (length/N,) this rank's chunk: a view of the flat parameters, what the optimizer steps
    ready: int = 0  # gradients landed so far in this backward
    reduced: bool = False
    staged: torch.Tensor | None = None  # stage 2: the bucket's whole gradients, only until reduce-scattered


@dataclass
class Shards:
    """This rank's view of the flat parameters and its chunks of them."""

    world: int
    stage: int
    flat: torch.Tensor  # (P,) every parameter back to back, bucket by bucket, each padded to a multiple of N
    grads: torch.Tensor | None  # stage 1: (P,) the full gradient buffer, p.grad views into it
    buckets: list[Bucket]
    offsets: dict[nn.Parameter, int] = field(default_factory=dict)  # each parameter's place in `flat`
    early: bool = False  # the zero:bucket-early bug

    @property
    def shards(self) -> list[nn.Parameter]:
        return [b.shard for b in self.buckets]


def _landed(z: Shards, b: Bucket, p: nn.Parameter) -> None:
    """Backward has accumulated p's gradient. Stage 2 moves it into the bucket's staging buffer and frees
    it; the bucket's last gradient starts its reduce-scatter."""
    if z.grads is None:
        if b.staged is None:
            b.staged = z.flat.new_zeros(b.end - b.start)
        at = z.offsets[p] - b.start
        b.staged[at:at + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None  # stage 2: no whole gradient outlives its bucket
    b.ready += 1
    if b.ready == (1 if z.early else len(b.params)) and not b.reduced:
        _reduce(z, b)


def _reduce(z: Shards, b: Bucket) -> None:
    with record_function(f"reduce-scatter bucket {b.index}"):
        grad = torch.empty_like(b.shard)
        whole = z.grads[b.start:b.end] if z.grads is not None else b.staged
        if whole is None:  # stage 2, a bucket none of whose parameters got a gradient this step
            whole = z.flat.new_zeros(b.end - b.start)
        reduce_scatter(grad, whole)  # the sum over the ranks of this rank's chunk
        b.shard.grad = grad.div_(z.world)  # the mean: what `single` computes on the whole batch
    b.staged, b.reduced = None, True


# A bug a hang's diagnosis must name (judge/named.py); a short --pg-timeout ends the others' wait in seconds.
BUG_RANK = 1


@dataclass
class Options:
    zero_stage: int = field(default=1, metadata={"help": "1: optimizer state sharded; 2: gradients too"})
    bucket_mb: float = field(default=0.0, metadata={"help": "gradient bucket cap in MiB; 0 = 25, DDP's default"})

    def __post_init__(self):
        if self.zero_stage not in (1, 2):
            raise ConfigError(f"--zero-stage must be 1 or 2, got {self.zero_stage} (stage 3 is `fsdp`)")
        if not self.bucket_mb >= 0:
            raise ConfigError(f"--bucket-mb must be 0 (the default, 25) or more, got {self.bucket_mb}")


def check(run) -> None:
    run.check_divisible(run.world_size, "world size")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
WRONG_SLICE = Mutant("zero:wrong-slice", "each rank's optimizer steps the next rank's chunks of the parameters "
                     "with its own chunks' gradient (a shard offset off by one rank)")
NO_ALL_GATHER = Mutant("zero:no-all-gather", "the updated chunks are never all-gathered: each rank sees only "
                       "its own chunks move", {"options": {"zero_stage": 2}})
BUCKET_EARLY = Mutant("zero:bucket-early", "a bucket is reduce-scattered when its first gradient lands, not its "
                      "last: the rest of it is reduced before backward has written it", {"workload": "cnn",
                                                                                          "options": {"zero_stage": 2}})
UNEVEN_PADDING = Mutant("zero:uneven-padding", f"rank {BUG_RANK} cuts each bucket into N chunks of numel // N + 1 "
                        "elements, not ceil(numel / N) (an off-by-one in its own copy of the padding): where N "
                        "divides a bucket, its reduce-scatter and all-gather carry N elements more than the others'",
                        {"options": {"bucket_mb": 1}, "pg_timeout": 3}, shows="hang")
BF16_MASTER = Mutant("zero:bf16-master", "under bf16 weights, each chunk's master copy made in the chunk's own dtype "
                     "(a clone of it, not an fp32 copy): master weights kept in bf16",
                     {**ADAMW, "precision": "bf16-master"})
MUTANTS = (WRONG_SLICE, NO_ALL_GATHER, BUCKET_EARLY, UNEVEN_PADDING, BF16_MASTER)


def _held(t: Trainable) -> tuple[int, int, int, int]:
    """This rank's bytes of parameters (all), gradients (stage 1: all; stage 2: its chunks, as the
    optimizer's input), masters (bf16-master) and optimizer state (its chunks')."""
    z = t.state
    grads = tensor_bytes(z.grads) if z.grads is not None else param_bytes(z.shards)
    masters = sharded.master_bytes(z.shards, t.optimizer)
    return tensor_bytes(z.flat), grads, masters, optimizer_state_bytes(z.shards, t.optimizer) - masters


def model_state_bytes(t: Trainable, run) -> list[int]:
    return [sum(_held(t))] * run.world_size  # every rank alike


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """The parameters are whole on every rank after the all-gather: the model's own state. Under bf16-master
    the run's weights are the chunks' fp32 masters (loop/master.py), all-gathered here the way the chunks are."""
    state = {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}
    if not (found := master.masters(t.optimizer)):
        return state
    z = t.state
    kept = found[id(z.buckets[0].shard)].dtype  # fp32 (bf16 under the injected bug zero:bf16-master)
    whole = torch.zeros(z.flat.numel(), dtype=kept, device=z.flat.device)
    for b in z.buckets:
        all_gather(whole[b.start:b.end], found[id(b.shard)])
    return state | {name: whole[z.offsets[p]:][:p.numel()].view(p.shape).cpu().clone()
                    for name, p in t.model.named_parameters() if p in z.offsets}


def checkpoint_state(t: Trainable) -> dict:
    """The parameters under the model's names (every rank holds all of them: DCP writes them once), and this
    rank's chunks of the momentum under keys of its own, so each rank writes and reads only its chunks. A
    checkpoint resumes on the same number of ranks and buckets (else refused as not fitting)."""
    z, rank = t.state, td.get_rank() if td.is_initialized() else 0
    momenta = {}
    for b in z.buckets:  # the optimiser makes its state at the first step: made now, as zeros
        for key, value in optim.state_now(t.optimizer, b.shard).items():
            momenta[f"{key}_of_bucket_{b.index}_chunk_{rank}_of_{z.world}"] = value
    return {"model": t.model.state_dict(), **momenta, "step": torch.zeros((), dtype=torch.int64)}


def memory_layout(run, layout):
    return layout.replace(zero_stage=run.options.zero_stage)  # for the planner's memory


# Its measurement (parallel/measure/sharded.py): what each rank holds beside ZeRO's formula, each collective
# timed alone, the textbook's bytes (2 Psi) and the cost model's step.
MEASURE = sharded.Zero(_held, lambda t: [(b.end - b.start) * t.state.flat.element_size() for b in t.state.buckets])

HOOKS = Hooks(check=check, model_state_bytes=model_state_bytes, state_dict=state_dict,
              checkpoint_state=checkpoint_state, restore_checkpoint=loaded_in_place, memory_layout=memory_layout)
