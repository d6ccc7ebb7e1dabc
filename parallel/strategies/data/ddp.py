"""ddp: DistributedDataParallel, one process per device, launched by torchrun (gloo on CPU, nccl on GPU).

    torchrun --nproc_per_node=2 scripts/ddp.py [--accum K] [--bucket-mb MB]

The diff from `single`: the model is wrapped in DDP, and each rank trains on its 1/N share of the
global batch (the loop hands it out). During backward, DDP all-reduces gradients bucket by bucket as
soon as a bucket's gradients are ready, overlapping communication with the rest of backward:

    rank 0:  fwd(x[0:B/2]) -> bwd  ..grads of last layers.. | ..earlier layers..
                                   \\ all-reduce bucket 1   \\ all-reduce bucket 2   -> step
    rank 1:  fwd(x[B/2:B]) -> bwd  ... the same, averaged with rank 0 ...             -> step

After the all-reduce every rank holds the mean gradient over the global batch, so every rank takes
the same step `single` takes on the whole batch. With --accum K each rank splits its share into K
micro-batches and skips the all-reduce (no_sync) on all but the last.

--prescale 1 divides the loss by N instead of the gradients: backward then produces gradient/N at no
cost, and the hook all-reduces a sum, saving DDP's pass over every gradient (`div_` before the
all-reduce, torch's default_hooks._allreduce_fut). Measured on the MLP with one 16 MiB bucket, 2 gloo
ranks: exposed communication 1.08-1.21x a standalone all-reduce with it, 1.28-1.31x without.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch.autograd.profiler import record_function
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from parallel.kit import sync_batchnorm
from parallel.kit.tensors import state_bytes
from parallel.loop import optim
from parallel.loop.clipping import schedule_of
from parallel.loop.results import Rule
from parallel.loop.tokens import own_mean
from parallel.measure import replicas
from parallel.models.outputs import call
from parallel.strategies.base import ADAMW, Hooks, Mutant, Trainable, injected, make_optimizers
from parallel.world.errors import ConfigError

NAME = "ddp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    opts = run.options
    model = model.to(dist.device)
    if not injected(run, UNSYNCED_BN):  # BatchNorm over the global batch, as one device computes it
        model = sync_batchnorm.convert(model, dist.device)
    if hasattr(model, "parts"):  # the DCGAN: a DDP per part, since each part has its own optimiser and backward
        t = Trainable(model, make_optimizers(model, make_optimizer), loss_fn, dist.device,
                      state=State(dist.world_size, compress=opts.compress,
                                  parts={k: _wrap(m, dist, opts) for k, m in model.parts().items()}))
        for part in t.state.parts.values():
            part.register_comm_hook(t, _allreduce)
        return t
    rule = {f"{n}": optim.kind_of(p) for n, p in model.named_parameters()}  # the bug's: by name, before DDP
    ddp = _wrap(model, dist, opts)
    optimizer = make_optimizer(optim.by_name(ddp.named_parameters(), rule) if injected(run, DECAY_BY_NAME)
                               else ddp.parameters())
    if injected(run, LR_TIMES_N):
        for group in optimizer.param_groups:
            group["lr"] *= dist.world_size
    t = Trainable(ddp, optimizer, loss_fn, dist.device,
                  state=State(dist.world_size, accum=opts.accum, prescale=opts.prescale, compress=opts.compress))
    ddp.register_comm_hook(t, _allreduce)
    return t


def train_step(t: Trainable, batch, dist):
    if t.state.parts:  # the model's own update, through the DDP wrappers
        parts = t.state.parts
        x, y = (b.to(t.device, non_blocking=True) for b in batch)
        return t.model.update(parts, t.optimizer, x, y, unsynced=lambda name: parts[name].no_sync())
    return _step(t, batch)


@dataclass
class State:
    world: int
    accum: int = 1  # micro-batches per optimiser step
    prescale: int = 0  # 1: the loss is divided by N, the hook all-reduces a sum
    compress: str = ""  # "bf16": the hook all-reduces bf16 copies of the buckets
    parts: dict | None = None  # the DCGAN: a DDP wrapper per part


def _allreduce(t: Trainable, bucket):  # no return annotation: DDP rejects a string one
    """DDP communication hook: what DDP does by default (divide by N, all-reduce); with prescale the
    gradients are already divided, so all-reduce the sum."""
    buf = bucket.buffer()
    with record_function(f"all-reduce bucket {bucket.index()}"):
        if injected(t, COMPRESSED_SUM):
            return td.all_reduce(buf.to(torch.bfloat16), async_op=True).get_future().then(
                lambda fut: buf.copy_(fut.value()[0]))
        if t.state.compress:  # cast to bf16 and divide by N, all-reduce, copy back into the fp32 bucket
            return default_hooks.bf16_compress_hook(None, bucket)
        summed = injected(t, SUM_NOT_MEAN) or (t.state.prescale and not injected(t, PRESCALE_TWICE))
        if summed:
            return td.all_reduce(buf, async_op=True).get_future().then(lambda fut: fut.value()[0])
        return default_hooks.allreduce_hook(None, bucket)


def _wrap(module, dist, opts):
    # gradient_as_bucket_view: gradients live in the buckets, saving a copy into and out of them
    # (measured on the MLP: exposed communication 1.13-1.35x a standalone all-reduce with, 1.38-1.48x without).
    return DDP(module, device_ids=[dist.device] if dist.device.type == "cuda" else None,
               bucket_cap_mb=opts.bucket_mb or None, gradient_as_bucket_view=True)


def _step(t: Trainable, batch, sync: bool = True):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    k = t.state.accum
    scale = (1 if injected(t, ACCUM_SUMMED) else k) * (t.state.world if t.state.prescale else 1)
    t.optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=t.device)
    loss_fn = own_mean(t.loss_fn) if injected(t, RANK_MEAN) or injected(t, ACCUM_BY_STEPS) else t.loss_fn
    for i, (xb, yb) in enumerate(zip(x.chunk(k), y.chunk(k), strict=True)):
        last = i == k - 1
        # no_sync: gradients accumulate locally; the all-reduce happens in the last backward only.
        with contextlib.nullcontext() if (last and sync and not injected(t, NO_SYNC_ALWAYS)) else t.model.no_sync():
            loss = loss_fn(call(t.model, xb, yb), yb)  # the micro-batch's share of the global token mean
            (loss / scale).backward()  # mean over the share = mean of the k micro-means
        total += loss.detach() / k
        if not last and injected(t, SCHEDULE_PER_MICRO):  # the bug: the schedule stepped with each micro-batch
            schedule_of(t.optimizer).step()
    t.optimizer.step()
    return total


COMPRESS_RTOL = 0.1  # --compress bf16's own rule (see `tolerance`)


@dataclass
class Options:
    accum: int = field(default=1, metadata={"help": "micro-batches per rank per optimiser step, no_sync() on all "
                                                    "but the last"})
    bucket_mb: float = field(default=0.0, metadata={"help": "DDP gradient bucket cap in MiB; 0 = torch's "
                                                            "default (25, first bucket 1)"})
    prescale: int = field(default=0, metadata={"help": "1: divide the loss by N, not the gradients "
                                                       "(saves a pass over them)"})
    compress: str = field(default="", metadata={"help": "bf16: all-reduce gradients as bfloat16 (torch's "
                                                        "bf16_compress_hook), half the bytes, not exact"})

    def __post_init__(self):
        if self.accum < 1:
            raise ConfigError(f"--accum must be at least 1, got {self.accum}")
        if not self.bucket_mb >= 0:
            raise ConfigError(f"--bucket-mb must be 0 (torch's default) or more, got {self.bucket_mb}")
        if self.prescale not in (0, 1):
            raise ConfigError(f"--prescale must be 0 or 1, got {self.prescale}")
        if self.compress not in ("", "bf16"):
            raise ConfigError(f"--compress must be bf16 or empty (no compression), got {self.compress!r}")
        if self.compress and self.prescale:
            raise ConfigError("--compress bf16 divides the gradients by N itself; --prescale 1 would divide twice")


def check(run) -> None:
    opts = run.options
    if run.workload.multi_part and (opts.accum > 1 or opts.prescale):
        raise ConfigError(f"--accum and --prescale apply to one loss; the {run.config.workload} workload has several")
    run.check_divisible(run.world_size * opts.accum, f"world size {run.world_size} x accum {opts.accum} =")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant): each is tested where it would be written.
SUM_NOT_MEAN = Mutant("ddp:sum-not-mean", "gradients summed over the ranks, not averaged")
LR_TIMES_N = Mutant("ddp:lr-times-n", "learning rate multiplied by N, as if the global batch had grown N-fold",
                    {"workload": "cnn"})
UNSYNCED_BN = Mutant("ddp:unsynced-batchnorm", "BatchNorm normalises each rank's share by its own statistics, "
                                                "not the global batch's", {"workload": "dcgan"})
ACCUM_SUMMED = Mutant("ddp:accum-summed", "gradient accumulation sums the micro-batch losses instead of averaging",
                      {"options": {"accum": 2}})
NO_SYNC_ALWAYS = Mutant("ddp:no-sync-always", "no_sync() on the last micro-batch too: gradients never all-reduced",
                        {"workload": "cnn", "options": {"accum": 2}})
PRESCALE_TWICE = Mutant("ddp:prescale-twice", "the loss divided by N and the gradients averaged as well",
                        {"options": {"prescale": 1}})
COMPRESSED_SUM = Mutant("ddp:compressed-sum", "bf16 gradient compression that casts and all-reduces but never "
                        "divides by N", {"options": {"compress": "bf16"}})
RANK_MEAN = Mutant("ddp:rank-mean", "uneven tokens: each rank's loss the mean over its own real tokens, averaged "
                   "over the ranks, so a token of a rank with few counts more (docs/loss.md)",
                   {"workload": "transformer", "tokens": "padded"})
ACCUM_BY_STEPS = Mutant("ddp:accum-by-steps", "uneven tokens: accumulation divides each micro-batch's own token mean "
                        "by the steps, not by the tokens (docs/loss.md)",
                        {"workload": "transformer", "tokens": "padded", "options": {"accum": 2}})
DECAY_BY_NAME = Mutant("ddp:decay-by-wrapped-name", "weight decay's exemptions (norms, biases, embeddings) looked "
                       "up by name after DDP renamed every parameter module.*: none is found, all decay",
                       {**ADAMW, "weight_decay": 0.5})
SCHEDULE_PER_MICRO = Mutant("ddp:schedule-per-microbatch", "the learning-rate schedule stepped once per "
                            "micro-batch, not per optimiser step: the warm-up ends accum times too soon",
                            {**ADAMW, "options": {"accum": 4}, "batch_size": 16})
MUTANTS = (SUM_NOT_MEAN, LR_TIMES_N, UNSYNCED_BN, ACCUM_SUMMED, NO_SYNC_ALWAYS, PRESCALE_TWICE, COMPRESSED_SUM,
           RANK_MEAN, ACCUM_BY_STEPS, DECAY_BY_NAME, SCHEDULE_PER_MICRO)


def model_state_bytes(t: Trainable, run) -> list[int]:
    """Every rank holds the whole model, its gradients (in the buckets) and the optimiser state."""
    return [state_bytes(list(_plain(t).parameters()), t.optimizer)] * run.world_size


def _plain(t: Trainable):
    return t.model.module if isinstance(t.model, DDP) else t.model


def _bucket_bytes(t: Trainable) -> list[int]:
    return replicas.ddp_bucket_bytes(t.state.parts.values() if t.state.parts else [t.model])


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in _plain(t).state_dict().items()}


def tolerance(run) -> Rule | None:
    """--compress bf16 rounds every gradient to bf16 (relative step 2^-8) and sums the ranks' shares in
    bf16 before the fp32 update, which `single` never does: it is judged by its own stated rule. Measured
    here against fp32 `single` on every workload, cpu:2 and cpu:3: up to 2.6% of a tensor's movement in 6
    steps on a batch of 48 (the DCGAN's generator; the MLP 0.4%). The rule allows 10%; a missing average or
    a doubled learning rate is of the order of the movement itself (`ddp:compressed-sum` is caught)."""
    if not run.options.compress:
        return None
    return Rule(COMPRESS_RTOL, 1e-2, 1e-3, f"ddp's own rule for bf16 gradient compression ({COMPRESS_RTOL:.0%} of each "
                                          "tensor's movement)")


def memory_layout(run, layout):
    return layout.replace(accum=run.options.accum)  # the activations of one micro-batch


MULTI_PART = True  # the DCGAN: each part its own DDP, each its own optimiser
SYNCS_BATCHNORM = True  # BatchNorm over the whole batch (SyncBatchNorm), as on one device
HALVES = {"accum": 2}  # on one device, its batch in two accumulated halves (the noise measurement's reference)

# Its measurement (parallel/measure/replicas.py): a step timed with and without the all-reduce, the buckets,
# the textbook's bytes and the cost model's step.
MEASURE = replicas.AllReduce(buckets=_bucket_bytes, step=_step)

HOOKS = Hooks(check=check, model_state_bytes=model_state_bytes, state_dict=state_dict, tolerance=tolerance,
              memory_layout=memory_layout)
