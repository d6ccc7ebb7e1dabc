"""The all-to-all of expert parallelism (by hand): a routed layer's rows to the ranks holding their experts,
through those experts, and back (strategies/expert_parallel.py puts a `Dispatch` in every MoE layer).

    rows sorted by expert ----- counts: all-to-all (E per rank) ----->  how many rows come from whom
    rows --------- all-to-all, splits = rows per destination rank ---->  the rank's experts on them
    y <------------------ all-to-all, the splits swapped -------------  outputs go home, gate-weighted there

`_AllToAll` is a torch.autograd.Function: its backward is the all-to-all with the splits swapped, so each
expert's gradient is of every row routed to it, from every rank of the group. The received rows are
source-major (all of rank 0's, then rank 1's), each source's by expert: they are regrouped by expert
for the experts, and put back before the return trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as td

from parallel.devices import synchronizer
from parallel.moe import MoE, Routing, combine, run_experts


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks of `group`: in_splits[r] of them to rank r, out_splits[r] from it. Backward: the
    gradients back the same way, the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        td.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        td.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


@dataclass
class Dispatch:
    """The routed layers' `dispatch` on this rank (moe.MoE's seam), and what it saw in the counted steps."""

    group: object  # the expert-parallel group (None: a world of one)
    ep: int
    world_group: object  # every rank: the routers' counts for the auxiliary loss
    gated: bool = True
    transposed: bool = False  # mutant
    local_counts: bool = False  # mutant
    counting: bool = True  # the counted (warm-up) steps: record the rows below
    rows_out: int = 0  # rows sent to other ranks (dispatch), over the counted steps
    rows_in: int = 0  # rows received from other ranks
    rows_routed: int = 0  # every kept row of this rank's tokens (its own experts' included)
    dropped: int = 0  # assignments dropped past the capacity, every step
    assigned: int = 0  # assignments made, every step
    load: list = field(default_factory=list)  # per call: rows each of this rank's experts computed
    expert_s: float = 0.0  # seconds in this rank's experts (counted steps)
    element: tuple = (4, 4)  # bytes per element of the rows going out and of the outputs coming back (bf16: 4, 2)
    calls: int = 0

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        if self.local_counts or self.world_group is None:
            return counts
        total = counts.detach().clone()
        td.all_reduce(total, group=self.world_group)
        return total

    def __call__(self, moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ep, local = self.ep, moe.num_experts // self.ep
        self.dropped += routing.dropped
        self.assigned += x.shape[0] * moe.top_k
        rows = x[routing.token]  # (R, C), sorted by expert: the rows for rank r are contiguous
        counts = got_counts = routing.counts
        if self.group is not None:
            got_counts = torch.empty_like(counts)
            td.all_to_all_single(got_counts, counts, group=self.group)  # [source][my expert] counts
        send = counts.view(ep, local).sum(1).tolist()
        grid = got_counts.view(ep, local)
        recv = grid.sum(1).tolist()
        got = _AllToAll.apply(rows, recv, send, self.group) if self.group is not None else rows
        # the received rows are source-major (all of rank 0's, then rank 1's ...), each source's by expert
        expert = torch.arange(local, device=x.device).repeat(ep)
        sizes = grid.reshape(-1)
        if self.transposed:  # read as expert-major: the same total, other rows per expert
            expert, sizes = torch.arange(local, device=x.device).repeat_interleave(ep), grid.t().reshape(-1)
        order = torch.argsort(expert.repeat_interleave(sizes), stable=True)
        per_expert = grid.sum(0).tolist()
        sync = synchronizer(x.device) if self.counting else lambda: None  # only in the counted, untimed steps
        sync()
        start = time.perf_counter()
        out = run_experts(moe.experts, got[order], per_expert)
        sync()
        if self.counting:
            self.expert_s += time.perf_counter() - start
            rank = td.get_rank(self.group) if self.group is not None else 0
            self.rows_out += sum(send) - send[rank]
            self.rows_in += sum(recv) - recv[rank]
            self.rows_routed += sum(send)
            self.load.append(per_expert)
            self.calls += 1
            self.element = (rows.element_size(), out.element_size())
        out = out[torch.argsort(order)]  # back to the order received
        back = _AllToAll.apply(out, send, recv, self.group) if self.group is not None else out
        return combine(x, routing, back, gated=self.gated)
