"""torch_cp: torch's own context parallelism, `context_parallel()` around the step (CUDA only).

    torchrun --nproc_per_node=2 scripts/torch_cp.py --workload transformer --seq-len 256 --devices cuda:0,1

The diff from `context_parallel` (ours, by hand): nothing in the model changes. Inside torch's
`context_parallel(mesh, buffers=[tokens, targets, positions], buffer_seq_dims=[1, 1, 1])` the buffers are
cut along the sequence in place, head-tail (zig-zag) when T divides by 2C, and F.scaled_dot_product_attention
is patched to a ring over the mesh that passes K,V by all-gather (torch 2.13's default rotate method). The
gradients are averaged over the ranks by hand afterwards, as in `context_parallel`.

It does not run on CPU: torch 2.13 dispatches only the CUDA flash / efficient / cuDNN attention kernels to
its ring (tensor/experimental/_context_parallel/_attention.py, `_sdpa_handler`); CPU's
aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy, and the math backend fails
mixing Tensor and DTensor (measured on gloo, 2 and 4 ranks). `preflight` runs it on GPUs.
"""

from __future__ import annotations

import torch

from parallel.kit.ring_attention import split_check
from parallel.strategies.base import Hooks, Trainable
from parallel.strategies.model.context_parallel import average_gradients
from parallel.world.devices import SHARED_GLOO_NO_DTENSOR
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "torch_cp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    model = model.to(dist.device)
    mesh = dims(run, dist).mesh(dist.device.type)
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=mesh)


def train_step(t: Trainable, batch, dist):
    from torch.distributed.tensor.experimental import context_parallel

    mesh = t.state
    x, y = (b.to(t.device).clone() for b in batch)  # (B, T): cut in place to this rank's (B, T/C) inside
    positions = torch.arange(x.shape[1], device=t.device).unsqueeze(0)  # (1, T), cut alike
    t.optimizer.zero_grad(set_to_none=True)
    with context_parallel(mesh, buffers=[x, y, positions], buffer_seq_dims=[1, 1, 1],
                          no_restore_buffers={x, y, positions}):
        loss = t.loss_fn(t.model(x, positions=positions), y)  # the mean over this rank's tokens
        loss.backward()
    average_gradients(list(t.model.parameters()), dist.world_size)
    t.optimizer.step()
    return loss.detach()


CPU_WHY = ("needs CUDA: torch's context_parallel() dispatches only CUDA's flash, efficient and cuDNN attention "
           "to its ring (on CPU: no sharding strategy for aten._scaled_dot_product_flash_attention_for_cpu)")


def check(run) -> None:
    if why := split_check("zigzag", run.world_size, run.workload.input_shape[0]):
        raise ConfigError(why)  # torch falls back to contiguous shards; its own causal rule assumes head-tail


def available(spec) -> str | None:
    if not spec.real:
        return CPU_WHY
    return SHARED_GLOO_NO_DTENSOR if spec.shared else None


def dims(run, dist) -> ParallelDims:
    return ParallelDims(world=run.world_size, cp=run.world_size)


SEQUENCE = True

HOOKS = Hooks(available=available, dims=dims, check=check)
