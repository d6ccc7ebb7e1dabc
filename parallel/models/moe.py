"""A mixture-of-experts layer (Shazeer et al. 2017; Mixtral's top-k routing), written to be read and to be split.

    x (N tokens, C) -> router -> softmax over E experts -> top k per token, gates renormalised to sum to 1
      -> the (token, expert) assignments sorted by expert (`Routing`) -> each expert's MLP on its rows
      -> y[token] = sum over its k experts of gate x expert(x[token])

Where the rows are computed is the layer's one seam, `MoE.dispatch`: a callable (moe, x, routing) -> y.
`run_here` (the default) runs every expert in this process; expert parallelism
(strategies/model/expert_parallel.py) sends each row to the rank that holds its expert and back, by
all-to-all. Everything else (the router, the order of the rows, the combine) is this module's, so both
compute the same thing.

Two options, both off by default so that every strategy can train the model:
- `capacity_factor` c > 0 caps the rows an expert takes from one call at ceil(c x N x k / E) (Megatron's
  capacity rule, the earlier tokens kept: its "position" policy); the assignments past it are dropped
  (their token keeps only the residual). Set by a strategy on its own layers: the cap depends on how many
  tokens one call sees, so a run with drops is not `single`'s.
- `aux_weight` w > 0 adds the load-balancing loss w x E x sum_e f_e x P_e (Switch Transformer; f_e the
  share of assignments routed to e, P_e the mean router probability of e). f is a count: `dispatch.global_
  counts` sums it over every rank that holds part of the batch (a data-parallel run then computes the
  whole batch's f), P is a mean each rank takes over its own tokens and the loop's averaging of gradients
  over ranks finishes; so the loss over ranks is the whole batch's. Its gradient enters in backward
  (`_AuxLoss`, Megatron's MoEAuxLossAutoScaler) at weight 1 per rank: the training loss a step reports
  does not include it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class Expert(nn.Module):
    """One expert: a GELU MLP, width -> hidden -> width."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


@dataclass
class Routing:
    """One call's assignments, sorted by expert (stable: token order within an expert).

    token   (R,) the token of each kept assignment          gate  (R,) its weight
    counts  (E,) kept assignments per expert (R in all)     dropped  assignments past the capacity
    """

    token: torch.Tensor
    gate: torch.Tensor
    counts: torch.Tensor
    dropped: int = 0


def run_experts(experts, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Expert i of `experts` on the next counts[i] rows of `rows` (rows grouped by expert, in order)."""
    chunks = rows.split(counts)
    return torch.cat([e(c) for e, c in zip(experts, chunks, strict=True)]) if rows.shape[0] else rows * 0


def combine(x: torch.Tensor, routing: Routing, rows_out: torch.Tensor) -> torch.Tensor:
    """y[token] = sum of gate x its experts' outputs, in x's dtype (under bf16 autocast the experts' outputs
    are bf16 and x, a LayerNorm's output, fp32); tokens with no kept assignment get 0."""
    rows_out = rows_out.to(x.dtype)
    return torch.zeros_like(x).index_add(0, routing.token, rows_out * routing.gate[:, None].to(x.dtype))


def run_here(moe: MoE, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Every expert in this process: the rows of each, then the weighted sum back to the tokens."""
    return combine(x, routing, run_experts(moe.experts, x[routing.token], routing.counts.tolist()))


run_here.global_counts = lambda counts: counts  # one process holds the whole batch


class _AuxLoss(torch.autograd.Function):
    """y unchanged forward; in backward, y's gradient and a gradient of 1 for the auxiliary loss."""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.dtype = aux.dtype
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.dtype, device=grad.device)


class MoE(nn.Module):
    """E experts, each token routed to its top k (see the module's docstring)."""

    def __init__(self, width: int, experts: int = 4, top_k: int = 2, hidden: int = 0, aux_weight: float = 0.0):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in 1..{experts}, got {top_k}")
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = nn.ModuleList(Expert(width, hidden or 2 * width) for _ in range(experts))
        self.num_experts, self.top_k, self.aux_weight = experts, top_k, aux_weight
        self.capacity_factor = 0.0  # 0: dropless
        self.dispatch = run_here  # (moe, x, routing) -> y: where the experts run (expert parallelism's seam)

    def route(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """(the sorted assignments, the router's probabilities (N, E))."""
        n, e, k = x.shape[0], self.num_experts, self.top_k
        logits = self.router(x)
        probs = F.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # at least fp32
        #   (Megatron and torchtitan route in fp32: under bf16 autocast the logits are bf16)
        gate, expert = probs.topk(k, dim=-1)  # (N, k) each
        gate = gate / gate.sum(dim=-1, keepdim=True)
        expert, gate = expert.reshape(-1), gate.reshape(-1)  # token-major: token 0's k, then token 1's, ...
        token = torch.arange(n, device=x.device).repeat_interleave(k)
        dropped = 0
        if self.capacity_factor > 0:
            capacity = math.ceil(self.capacity_factor * n * k / e)
            place = F.one_hot(expert, e).cumsum(0).gather(1, expert[:, None]).squeeze(1) - 1  # its place in line
            keep = place < capacity
            dropped = int((~keep).sum())
            expert, gate, token = expert[keep], gate[keep], token[keep]
        order = torch.argsort(expert, stable=True)
        counts = torch.bincount(expert, minlength=e)
        return Routing(token[order], gate[order], counts, dropped), probs

    def aux_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """w x E x sum_e f_e P_e, f from every rank's counts (dispatch.global_counts), P from this rank's."""
        total = self.dispatch.global_counts(counts.to(probs.dtype))
        share = total / total.sum()
        return self.aux_weight * self.num_experts * (share * probs.mean(0)).sum()

    def forward(self, x):  # (..., C) -> (..., C)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        routing, probs = self.route(x)
        y = self.dispatch(self, x, routing)
        if self.aux_weight and self.training:
            # f counts every assignment the router made (dropped ones too): the balance it asks for is the router's
            every = torch.bincount(probs.topk(self.top_k, dim=-1).indices.reshape(-1), minlength=self.num_experts)
            y = _AuxLoss.apply(y, self.aux_loss(probs, every))
        return y.reshape(shape)
