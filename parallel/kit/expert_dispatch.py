"""The all-to-all of expert parallelism (by hand): a routed layer's rows to the ranks holding their experts,
through those experts, and back (strategies/model/expert_parallel.py puts a `Dispatch` in every MoE layer).

    rows sorted by expert ----- counts: all-to-all (E per rank) ----->  how many rows come from whom
    rows --------- all-to-all, splits = rows per destination rank ---->  the rank's experts on them
    y <------------------ all-to-all, the splits swapped -------------  outputs go home, gate-weighted there

`collectives.all_to_all` is differentiable: its backward is the all-to-all with the splits swapped, so each
expert's gradient is of every row routed to it, from every rank of the group. The received rows are
source-major (all of rank 0's, then rank 1's), each source's by expert: they are regrouped by expert
for the experts, and put back before the return trip.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td

from parallel.kit.collectives import all_to_all
from parallel.models.moe import MoE, Routing, combine, run_experts


@dataclass
class Dispatch:
    """The routed layers' `dispatch` on this rank (moe.MoE's seam). Its steps (global_counts, plan, order,
    run, combine) are methods that a measurement may wrap, or an injected bug replace, on the instance."""

    group: object  # the expert-parallel group (None: a world of one)
    ep: int
    world_group: object  # every rank: the routers' counts for the auxiliary loss
    dropped: int = 0  # assignments dropped past the capacity, every step
    assigned: int = 0  # assignments made, every step
    run = staticmethod(run_experts)  # (experts, rows grouped by expert, rows per expert) -> their outputs
    combine = staticmethod(combine)  # (x, routing, outputs back in routing's order) -> y

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """The routers' counts over the whole batch: summed over every rank."""
        if self.world_group is None:
            return counts
        total = counts.detach().clone()
        td.all_reduce(total, group=self.world_group)
        return total

    def plan(self, counts: torch.Tensor) -> tuple[list[int], list[int], torch.Tensor]:
        """From this rank's rows per expert (E,): the rows it sends each rank of the group, the rows it gets
        from each, and those as a grid (ep, E/ep) [source][my expert] (the counts' all-to-all)."""
        got = counts
        if self.group is not None:
            got = torch.empty_like(counts)
            td.all_to_all_single(got, counts, group=self.group)
        grid = got.view(self.ep, -1)
        return counts.view(self.ep, -1).sum(1).tolist(), grid.sum(1).tolist(), grid

    @staticmethod
    def order(grid: torch.Tensor) -> torch.Tensor:
        """The permutation that groups the received rows by expert: they come source-major (all of rank 0's,
        then rank 1's ...), each source's by expert."""
        expert = torch.arange(grid.shape[1], device=grid.device).repeat(grid.shape[0])
        return torch.argsort(expert.repeat_interleave(grid.reshape(-1)), stable=True)

    def __call__(self, moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.dropped += routing.dropped
        self.assigned += x.shape[0] * moe.top_k
        rows = x[routing.token]  # (R, C), sorted by expert: the rows for rank r are contiguous
        send, recv, grid = self.plan(routing.counts)
        got = all_to_all(rows, self.group, recv, send) if self.group is not None else rows
        order = self.order(grid)
        out = self.run(moe.experts, got[order], grid.sum(0).tolist())[torch.argsort(order)]  # back to as received
        back = all_to_all(out, self.group, send, recv) if self.group is not None else out
        return self.combine(x, routing, back)
