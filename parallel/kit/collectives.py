"""Collectives by hand that several strategies share, and the names of torch's across versions."""

from __future__ import annotations

import torch
import torch.distributed as td

from parallel.world.dist import local

# gloo has reduce_scatter_single / all_gather_single in torch 2.13; torch 2.11 (the oldest the suite ran on)
# has only reduce_scatter_tensor / all_gather_into_tensor (deprecated names in 2.13).
reduce_scatter = getattr(td, "reduce_scatter_single", None) or td.reduce_scatter_tensor
all_gather = getattr(td, "all_gather_single", None) or td.all_gather_into_tensor


def every_rank(value) -> list:
    """`value` from every rank of the process group, in rank order (a collective: every rank calls it);
    [value] in a world of one."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [value]
    out = [None] * td.get_world_size()
    td.all_gather_object(out, value)
    return out


def rank0_says(flag: bool, device: torch.device) -> bool:
    """Rank 0's `flag` on every rank (a collective): for a decision each rank would take on its own clock,
    such as when a timing loop has spent its budget, which must be the same on every rank or the one that
    goes on waits in a collective the others never issue."""
    if not td.is_initialized() or td.get_world_size() == 1:
        return flag
    said = torch.tensor([float(flag)], device=device)
    td.broadcast(said, 0)
    return bool(said.item())


def sum_gradients(params, divide_by: int, group=None) -> None:
    """The gradients of `params` summed over `group` (None: every rank) in one flat all-reduce, then divided
    by `divide_by` (the ranks whose mean losses make the step's: context and expert parallelism). A
    parameter with no gradient this step (an expert no row reached, a router whose gates were unused)
    counts as zero, so every rank sends the same flat tensor. A DTensor's gradient is summed as what this
    rank holds of it (its local shard: under no_grad, to_local is that shard itself)."""
    import torch.distributed as td

    params = list(params)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    with torch.no_grad():
        grads = [local(p.grad) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        td.all_reduce(flat, group=group)
        flat /= divide_by
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def sum_as_made(params, group=None) -> None:
    """Each parameter's gradient summed over `group` as backward makes it (a hook on the tensor): a weight
    every rank holds whole but applies to its own part of the activations (Qwen3's q_norm, to this rank's
    heads) gets from backward that part's gradient only (TPPlan.summed)."""
    for p in params:
        p.register_hook(lambda grad: _summed(grad, group))


def _summed(grad: torch.Tensor, group) -> torch.Tensor:
    grad = grad.clone(memory_format=torch.contiguous_format)  # a hook returns a new gradient, never edits it
    td.all_reduce(grad, group=group)
    return grad


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        ctx.group, ctx.splits = group, (out_splits, in_splits)
        x = x.contiguous()  # the collective reads and writes memory in row order (a gradient may be strided)
        out = x.new_empty((sum(out_splits), *x.shape[1:])) if out_splits else torch.empty_like(x)
        td.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return all_to_all(grad, ctx.group, in_splits, out_splits), None, None, None


def all_to_all(x: torch.Tensor, group, out_splits: list[int] | None = None,
               in_splits: list[int] | None = None) -> torch.Tensor:
    """Rows of `x` (dim 0) to the ranks of `group`: in_splits[r] of them to rank r, out_splits[r] received
    from it (None: equal chunks, one a rank). Differentiable: the backward is the same all-to-all with the
    splits swapped, so each row's gradient goes home to the rank that sent it (expert parallelism's
    dispatch, Ulysses' turn between a split of the sequence and a split of the heads). torch's own,
    torch.distributed.nn.functional.all_to_all_single, is deprecated in 2.13 for the functional
    collectives'."""
    return _AllToAll.apply(x, group, out_splits, in_splits)
