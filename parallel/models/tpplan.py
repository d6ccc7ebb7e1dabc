"""TPPlan: how a model is split for tensor parallelism, by module name (what a model's tp_plan() returns)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TPPlan:
    """How a model is split for tensor parallelism (Megatron, Shoeybi et al. 2019), by module name.

    colwise   Linear layers split by their outputs: each rank computes its columns of the output
    rowwise   Linear layers split by their inputs: each rank's partial output, summed over the ranks
    regions   modules whose input enters several colwise layers (attention's q, k, v): it is copied to
              the ranks once, and its gradient summed once; a colwise layer outside a region is its own
    summed    modules every rank holds whole but applies to its own part (Qwen3's q_norm, on this rank's
              heads): their parameters' gradients summed over the ranks (transformers'
              "replicated_with_grad_allreduce"); manual_tp and tensor_parallel do it, fsdp_tp refuses it

    Every other module is replicated: each rank holds all of it and computes the same thing. A colwise
    layer feeds a rowwise one with nothing between them but element-wise functions (or attention over
    whole heads), so a pair costs one all-reduce forward (the rowwise output) and one backward (the
    region's input gradient)."""

    colwise: tuple[str, ...]
    rowwise: tuple[str, ...]
    regions: tuple[str, ...] = ()
    summed: tuple[str, ...] = ()

    @classmethod
    def joined(cls, plans) -> TPPlan:
        plans = list(plans)
        return cls(*(tuple(n for p in plans for n in getattr(p, f)) for f in ("colwise", "rowwise", "regions",
                                                                                 "summed")))

