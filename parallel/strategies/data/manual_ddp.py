"""manual_ddp: DistributedDataParallel by hand, one process per device: the two ideas of torch's DDP.

    torchrun --nproc_per_node=2 scripts/manual_ddp.py [--bucket-mb MB] [--naive 1]

The diff from `single`: each rank trains on its 1/N share of the global batch (the loop hands it out),
and before the optimizer step every gradient is averaged over the ranks, so every rank takes the step
`single` takes on the whole batch (Li et al., "PyTorch Distributed", VLDB 2020).

naive (--naive 1): a hook on every parameter all-reduces its gradient as soon as backward has
    accumulated it, and divides by N. One collective per parameter, each waited for inside backward
    (picotron's DataParallelNaive).

bucketed (the real one; --bucket-mb MB, 0 = 25 as DDP's default): gradients live in flat buckets of about
    MB, filled in the order
    backward produces them (the last layers first). When a bucket's last gradient lands, its all-reduce
    starts asynchronously and backward goes on with the earlier layers; before the step, wait for all.

    backward:  [fc3 fc2 | fc1 conv2 | conv1]   grads land, last layer first
    buckets:    bucket 0 ---all-reduce--->     bucket 1 ---all-reduce--->   bucket 2 -->|wait, /N, step

Each parameter's .grad is a view into its bucket (DDP's gradient_as_bucket_view), so there is no copy
into or out of the buckets; zero_grad zeroes the views in place instead of dropping them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn
from torch.autograd.profiler import record_function

from parallel.kit.tensors import state_bytes
from parallel.measure import replicas
from parallel.models.outputs import call
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.world.errors import ConfigError

NAME = "manual_ddp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    opts = run.options
    model = model.to(dist.device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:  # every rank starts from rank 0's weights, as DDP's constructor ensures
        td.broadcast(p.detach(), src=0)
    sync = Sync(dist.world_size)
    if dist.rank == BUG_RANK:
        sync.deferred = injected(run, BUCKETS_REORDERED)
        sync.skip_at = SKIPPED_AT if injected(run, BUCKET_SKIPPED) else -1
    hooked = params
    if not opts.naive:
        groups = buckets_in_backward_order(params, (opts.bucket_mb or DEFAULT_BUCKET_MB) * 2**20)
        if injected(run, LAST_BUCKET_DROPPED):
            groups = groups[:-1]
        sync.buckets = [Bucket(i, g) for i, g in enumerate(groups)]
        sync.bucket_of = {p: b for b in sync.buckets for p in b.params}
        hooked = list(sync.bucket_of)
        hook = lambda p: _bucket_ready(sync, p)  # noqa: E731
    else:
        hook = lambda p: _naive(sync, p)  # noqa: E731
    for p in hooked:
        p.register_post_accumulate_grad_hook(hook)
    return Trainable(model, make_optimizer(params), loss_fn, dist.device, state=sync)


def train_step(t: Trainable, batch, dist):
    sync = t.state
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    if injected(t, SHARE_OFF_BY_ONE) and dist.rank == 0:
        x, y = x[:-1], y[:-1]
    # Zero the bucket views in place; None would detach them.
    t.optimizer.zero_grad(set_to_none=injected(t, GRADS_SET_TO_NONE))
    loss = t.loss_fn(call(t.model, x, y), y)  # the mean over this rank's share
    loss.backward()  # the hooks all-reduce as gradients land
    with record_function("wait for the buckets"):
        _finish(sync)
    t.optimizer.step()
    return loss.detach()


class Bucket:
    """A flat buffer holding the gradients of `params` back to back; all-reduced once all have landed."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index, self.params = index, params
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        offset = 0
        for p in params:  # each .grad a view of its slice: backward accumulates straight into the bucket
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        self.ready = 0
        self.work = None


@dataclass
class Sync:
    """What the hooks share: the buckets."""

    world: int
    buckets: list[Bucket] = field(default_factory=list)
    bucket_of: dict[nn.Parameter, Bucket] = field(default_factory=dict)
    step: int = 0  # steps this rank has finished
    deferred: bool = False  # the manual_ddp:buckets-reordered bug: this rank launches its buckets after backward
    skip_at: int = -1  # the manual_ddp:bucket-skipped bug: the step this rank leaves its last bucket out


def buckets_in_backward_order(params: list[nn.Parameter], cap_bytes: float) -> list[list[nn.Parameter]]:
    """Parameters in the order backward produces their gradients (reverse of the forward order), cut into
    groups of at least `cap_bytes` (the last one smaller)."""
    groups, size = [[]], 0
    for p in reversed(params):
        if size >= cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += p.numel() * p.element_size()
    return groups


def _naive(sync: Sync, p: nn.Parameter) -> None:
    """Backward has just accumulated p's gradient: average it over the ranks, now (blocking)."""
    with record_function("all-reduce one gradient"):
        td.all_reduce(p.grad, async_op=False)
    p.grad.div_(sync.world)


def _bucket_ready(sync: Sync, p: nn.Parameter) -> None:
    """One more gradient of its bucket has landed; the bucket's last one starts its all-reduce."""
    b = sync.bucket_of[p]
    b.ready += 1
    if b.ready == len(b.params) and not sync.deferred and not _skipped(sync, b):
        with record_function(f"all-reduce bucket {b.index}"):
            b.work = td.all_reduce(b.buffer, async_op=True)


def _finish(sync: Sync) -> None:
    """After backward: wait for every bucket (one whose parameters got no gradient this step is reduced
    now, so that every rank runs the same collectives), then divide the sums by N."""
    for b in reversed(sync.buckets) if sync.deferred else sync.buckets:
        if b.work is None and not _skipped(sync, b):
            b.work = td.all_reduce(b.buffer, async_op=True)
    for b in sync.buckets:
        if b.work is not None:
            b.work.wait()
        b.buffer.div_(sync.world)
        b.ready, b.work = 0, None
    sync.step += 1


def _skipped(sync: Sync, b: Bucket) -> bool:
    """The manual_ddp:bucket-skipped bug: at its step, on its rank, the last bucket is left out."""
    return sync.step == sync.skip_at and b.index == len(sync.buckets) - 1


# Bugs a hang's diagnosis must name (judge/named.py): each on rank BUG_RANK, with buckets of different sizes
# (1 MiB: the MLP's four), and a short --pg-timeout so the others' wait ends in seconds.
BUG_RANK, SKIPPED_AT = 1, 2  # SKIPPED_AT: the step at which manual_ddp:bucket-skipped leaves its bucket out

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb (DDP also makes its first bucket 1 MiB; this one does not)


@dataclass
class Options:
    bucket_mb: float = field(default=0.0, metadata={"help": "gradient bucket cap in MiB; 0 = 25, DDP's default"})
    naive: int = field(default=0, metadata={"help": "1: no buckets, one blocking all-reduce per parameter as its "
                                                    "gradient lands"})

    def __post_init__(self):
        if not self.bucket_mb >= 0:
            raise ConfigError(f"--bucket-mb must be 0 (the default, 25) or more, got {self.bucket_mb}")
        if self.naive not in (0, 1):
            raise ConfigError(f"--naive must be 0 or 1, got {self.naive}")


def check(run) -> None:
    run.check_divisible(run.world_size, "world size")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
LAST_BUCKET_DROPPED = Mutant("manual_ddp:last-bucket-dropped", "the last, smaller bucket is never made (an "
                             "off-by-one in the bucketing), so the first layer's gradients are never all-reduced",
                             {"options": {"bucket_mb": 1}})
SHARE_OFF_BY_ONE = Mutant("manual_ddp:share-off-by-one", "rank 0 trains on one sample fewer than its share "
                          "(an off-by-one slice)", {"workload": "cnn", "batch_size": 512})
GRADS_SET_TO_NONE = Mutant("manual_ddp:grads-set-to-none", "zero_grad(set_to_none=True): from step 1 the gradients "
                                                           "are fresh tensors, no longer views of the buckets reduced")
BUCKETS_REORDERED = Mutant("manual_ddp:buckets-reordered", f"rank {BUG_RANK} holds its bucket all-reduces back and "
                           "launches them all after backward, walking its list from the end (a reversed() meant "
                           "for the forward order): its n-th all-reduce is another bucket, of another size, than "
                           "the others' n-th", {"options": {"bucket_mb": 1}, "pg_timeout": 3}, shows="hang")
BUCKET_SKIPPED = Mutant("manual_ddp:bucket-skipped", f"at step {SKIPPED_AT} rank {BUG_RANK} leaves out the last "
                        "bucket's all-reduce (a \"nothing changed, skip it\" shortcut on one rank): the others wait "
                        "in it",
                        {"options": {"bucket_mb": 1}, "pg_timeout": 3}, shows="hang")
MUTANTS = (LAST_BUCKET_DROPPED, SHARE_OFF_BY_ONE, GRADS_SET_TO_NONE, BUCKETS_REORDERED, BUCKET_SKIPPED)


def model_state_bytes(t: Trainable, run) -> list[int]:
    """Every rank holds the whole model, its gradients (in the buckets) and the optimiser state."""
    return [state_bytes(list(t.model.parameters()), t.optimizer)] * run.world_size


# Its measurement (parallel/measure/replicas.py): the buckets, the textbook's bytes and the cost model's step.
MEASURE = replicas.AllReduce(buckets=lambda t: [b.buffer.numel() * b.buffer.element_size() for b in t.state.buckets])

HOOKS = Hooks(check=check, model_state_bytes=model_state_bytes)
