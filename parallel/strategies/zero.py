"""zero: ZeRO-1 and ZeRO-2 by hand (Rajbhandari et al., SC 2020): data parallel with the optimizer state sharded.

    torchrun --nproc_per_node=2 scripts/zero.py [--zero-stage 1|2]

The diff from `manual_ddp`: every rank still holds all the parameters and trains on its 1/N share of the
batch, but each rank owns one slice of them, and only that slice's optimizer state (SGD's momentum here):

    flat parameters (padded to a multiple of N):   [ rank 0's slice | rank 1's slice | ... | pad ]
    backward          every rank: the gradient of every parameter, on its share of the batch
    reduce-scatter    rank r receives the SUM of everyone's gradient for its slice only; / N = the mean
    optimizer.step()  torch's own update rule on the slice (its momentum: 1/N of DDP's optimizer state)
    all-gather        every rank's updated slice into every rank's parameters

    stage 1: the full gradient buffer stays allocated (as DDP's buckets); stage 2 frees it once it has been
             reduce-scattered, so at rest a rank holds 1/N of the gradients too.

Bytes a rank sends per step: reduce-scatter (N-1)/N x P + all-gather (N-1)/N x P = 2(N-1)/N x P, the
same as DDP's one all-reduce (the paper's 2 Psi), for 1/N of the optimizer state (and at stage 2 of the
gradients). Here stage 2 reduces after backward in one piece: the full gradient still exists during
backward (ZeRO-2 proper reduces bucket by bucket as backward produces them; not done yet).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn
from torch.autograd.profiler import record_function

from parallel.errors import ConfigError
from parallel.strategies.base import (
    Hooks,
    Mutant,
    Trainable,
    injected,
    loaded_in_place,
    optimizer_state_bytes,
    options_of,
    tensor_bytes,
)

NAME = "zero"
LAUNCH = "torchrun"
SYNCHRONOUS = True

# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
WRONG_SLICE = Mutant("zero:wrong-slice", "each rank's optimizer steps the next rank's slice of the parameters "
                     "with its own slice's gradient (a shard offset off by one rank)")
NO_ALL_GATHER = Mutant("zero:no-all-gather", "the updated slices are never all-gathered: each rank sees only "
                       "its own slice move", {"options": {"zero_stage": 2}})
MUTANTS = (WRONG_SLICE, NO_ALL_GATHER)

# gloo has reduce_scatter_single / all_gather_single in torch 2.13; the pyproject allows 2.6+, where they
# are reduce_scatter_tensor / all_gather_into_tensor (deprecated names in 2.13).
_reduce_scatter = getattr(td, "reduce_scatter_single", None) or td.reduce_scatter_tensor
_all_gather = getattr(td, "all_gather_single", None) or td.all_gather_into_tensor


@dataclass
class Options:
    zero_stage: int = field(default=1, metadata={"help": "1: optimizer state sharded; 2: gradients too"})

    def __post_init__(self):
        if self.zero_stage not in (1, 2):
            raise ConfigError(f"--zero-stage must be 1 or 2, got {self.zero_stage} (stage 3 is `fsdp`)")


@dataclass
class Shards:
    """This rank's view of the flat parameters and its slice of them."""

    world: int
    stage: int
    params: list[nn.Parameter]  # the model's, each a view of `flat`
    flat: torch.Tensor  # (P,) every parameter back to back, padded to a multiple of N
    shard: nn.Parameter  # (P/N,) this rank's slice of `flat`: what the optimizer steps
    grads: torch.Tensor | None  # stage 1: (P,) the full gradient buffer, p.grad views into it
    sent: dict[str, float] = field(default_factory=lambda: {"reduce_scatter": 0.0, "all_gather": 0.0})


def check(config) -> None:
    config.check_divisible(config.world_size, "world size")


def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable:
    stage, n = options_of(Options, config).zero_stage, dist.world_size
    model = model.to(dist.device)
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    size = math.ceil(total / n)  # each rank's slice; the last one padded
    flat = torch.zeros(size * n, dtype=params[0].dtype, device=dist.device)
    grads = torch.zeros_like(flat) if stage == 1 else None
    offset = 0
    for p in params:  # each parameter becomes a view of the flat buffer (its gradient, at stage 1, too)
        flat[offset:offset + p.numel()].copy_(p.detach().reshape(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        if grads is not None:
            p.grad = grads[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    td.broadcast(flat, src=0)  # every rank starts from rank 0's weights
    owner = (dist.rank + 1) % n if injected(config, WRONG_SLICE) else dist.rank
    shard = nn.Parameter(flat[owner * size:(owner + 1) * size])  # a view: stepping it moves the model's weights
    return Trainable(model, make_optimizer([shard]), loss_fn, dist.device, comm_bytes=0,
                     state=Shards(n, stage, params, flat, shard, grads))


def _full_gradient(z: Shards) -> torch.Tensor:
    """(P,) every parameter's gradient back to back: the stage-1 buffer, or at stage 2 a transient copy
    whose parts are freed as they are copied."""
    if z.grads is not None:
        return z.grads
    parts = []
    for p in z.params:
        parts.append(p.grad.reshape(-1))
        p.grad = None  # stage 2: no full gradient kept past this step
    pad = z.flat.numel() - sum(t.numel() for t in parts)
    return torch.cat(parts + [z.flat.new_zeros(pad)])


def train_step(t: Trainable, batch, dist):
    z = t.state
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    if z.grads is not None:
        z.grads.zero_()  # the parameters' .grad are views of it: zeroed in place, never set to None
    loss = t.loss_fn(t.model(x), y)  # the mean over this rank's share
    loss.backward()
    ring = (z.world - 1) / z.world * z.flat.numel() * z.flat.element_size()  # bytes a rank sends, each way
    with record_function("reduce-scatter gradients"):
        grad = torch.empty_like(z.shard)
        _reduce_scatter(grad, _full_gradient(z))  # the sum over the ranks of this rank's slice
        z.shard.grad = grad.div_(z.world)  # the mean: what `single` computes on the whole batch
    z.sent["reduce_scatter"] += ring
    t.optimizer.step()  # torch's update rule, on this rank's slice only (in place: the model's weights)
    z.shard.grad = None  # stage 2 keeps no gradient between steps; stage 1's lives in the buffer
    if not injected(t, NO_ALL_GATHER):
        with record_function("all-gather parameters"):
            _all_gather(z.flat, z.shard.detach().clone())  # every rank's slice into every rank's weights
        z.sent["all_gather"] += ring
    t.comm_bytes = sum(z.sent.values())
    return loss.detach()


def comm_bytes_predicted(model, config) -> float:
    """Reduce-scatter and all-gather of every parameter's worth, ring: 2(N-1)/N x P bytes (2 Psi)."""
    n = config.world_size
    padded = math.ceil(sum(p.numel() for p in model.parameters() if p.requires_grad) / n) * n
    return 2 * (n - 1) / n * padded * 4


def model_state_bytes(t: Trainable, config) -> list[int]:
    """Each rank: all parameters, the gradients (stage 1: all; stage 2: its slice, as the optimizer's
    input), and the optimizer state of its slice."""
    z = t.state
    grads = tensor_bytes(z.grads) if z.grads is not None else tensor_bytes(z.shard)
    return [tensor_bytes(z.flat) + grads + optimizer_state_bytes([z.shard], t.optimizer)] * config.world_size


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """The parameters are whole on every rank after the all-gather: the model's own state."""
    return {k: v.detach().cpu().clone() for k, v in t.model.state_dict().items()}


def extra_measurements(t: Trainable, data, config, dist, result) -> dict:
    z, steps = t.state, max(1, len(result.losses))
    n, psi = z.world, z.flat.numel() * z.flat.element_size()
    return {"zero_stage": z.stage, "bytes_per_step_by_collective": {k: v / steps for k, v in z.sent.items()},
            "param_bytes_per_rank": tensor_bytes(z.flat),
            "grad_bytes_per_rank": tensor_bytes(z.grads) if z.grads is not None else psi // n,
            "optimizer_state_bytes_per_rank": optimizer_state_bytes([z.shard], t.optimizer),
            # ZeRO's model state per device for fp32 SGD with momentum (K = 4 bytes of optimizer state per
            # parameter): DDP 12 Psi; stage 1: 4 + 4 + 4/N; stage 2: 4 + (4 + 4)/N (Psi = parameter count).
            "zero_formula_bytes": psi + (psi if z.stage == 1 else psi / n) + psi / n}


def checkpoint_state(t: Trainable) -> dict:
    """The parameters under the model's names (every rank holds all of them: DCP writes them once), and this
    rank's slice of the momentum under a key of its own, so each rank writes and reads only its slice. A
    checkpoint resumes on the same number of ranks (another N slices differently: refused as not fitting)."""
    z, rank = t.state, td.get_rank() if td.is_initialized() else 0
    opt = t.optimizer.state[z.shard]  # SGD creates its momentum at the first step: make it now, as zeros
    opt.setdefault("momentum_buffer", torch.zeros_like(z.shard))
    return {"model": t.model.state_dict(), f"momentum_of_slice_{rank}_of_{z.world}": opt["momentum_buffer"],
            "step": torch.zeros((), dtype=torch.int64)}


def predict_step_ms(cal, config, row) -> float | None:
    """Each rank's share of the compute, then the reduce-scatter and the all-gather, neither hidden behind
    backward (they come after it). A ring reduce-scatter and all-gather are each half an all-reduce's
    traffic on nccl; gloo's reduce-scatter is a whole all-reduce followed by a chunk (PR #118911)."""
    n = config.world_size
    allreduce = cal.allreduce_ms(cal.grad_bytes, n)
    if allreduce is None:
        return None
    reduce_scatter = allreduce / 2 if cal.overlaps else allreduce  # `overlaps`: real GPUs, nccl
    return cal.compute_ms(config.batch_size // n) + reduce_scatter + allreduce / 2


HOOKS = Hooks(check=check, comm_bytes_predicted=comm_bytes_predicted, model_state_bytes=model_state_bytes,
              state_dict=state_dict, extra_measurements=extra_measurements, predict_step_ms=predict_step_ms,
              checkpoint_state=checkpoint_state, restore_checkpoint=loaded_in_place)
