"""What a device holds of a tensor, and the model's whole state gathered from shards: sizes counted from
the local tensors (DTensor shards) and full state dicts on the CPU."""

from __future__ import annotations

import torch
from torch import nn

from parallel.world.dist import local


def tensor_bytes(t: torch.Tensor, allocated: bool = False) -> int:
    """Bytes of what this device holds of `t`: logical (elements x size), or allocated (the storage,
    padding of an uneven shard included)."""
    t = local(t)
    return t.untyped_storage().nbytes() if allocated else t.numel() * t.element_size()


def param_bytes(params, allocated: bool = False) -> int:
    return sum(tensor_bytes(p, allocated) for p in params)


def optimizer_state_bytes(params, optimizer, allocated: bool = False) -> int:
    """The optimiser's state for `params` (momentum, ...) that this device holds."""
    return sum(tensor_bytes(v, allocated) for p in params for v in optimizer.state.get(p, {}).values()
               if isinstance(v, torch.Tensor))


def state_bytes(params, optimizer, allocated: bool = False) -> int:
    """Parameters + their gradients + the optimiser's state for them (momentum, ...), counted from the
    tensors this device holds (local shards of DTensors)."""
    params = list(params)
    total = sum(tensor_bytes(p, allocated) + (tensor_bytes(p.grad, allocated) if p.grad is not None else 0)
                for p in params)
    return total + (optimizer_state_bytes(params, optimizer, allocated) if optimizer is not None else 0)


def gathered_on_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, each DTensor's local shard moved to the CPU first and gathered there
    (a collective, every rank in the same order). For gloo with CUDA tensors, where DTensor's own gather
    (torch's functional collectives) crashes the process: SIGSEGV in redistribute, seen on an H200 with
    two ranks sharing it (torch 2.11); gloo gathers CPU tensors the way every CPU run does."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    meshes: dict = {}
    out = {}
    for name, v in model.state_dict().items():
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            if mesh not in meshes:  # the same ranks, on the CPU (a 1-D mesh of the world uses the default group)
                meshes[mesh] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
            v = DTensor.from_local(v.to_local().detach().cpu(), meshes[mesh], v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride()).full_tensor()
        out[name] = v.detach().cpu().clone()
    return out
