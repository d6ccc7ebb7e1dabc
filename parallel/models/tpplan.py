"""TPPlan: how a model is split for tensor parallelism, by module name (what a model's tp_plan() returns),
and what a plan that splits a per-head norm's projection but not the norm leaves undone."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn


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


def head_norm(model: nn.Module, name: str, split: Iterable[str]) -> str:
    """How a plan's refusal names `name`, a norm beside the split layers `split` whose weight has a head
    dimension (Cohere's q_norm, (heads, head_dim); OLMo2's, heads x head_dim wide) after the split projection
    of that width, as "leaves ..." goes on; "" for any other weight (Qwen3's q_norm, (head_dim,), applied
    alike to every head: its gradient summed is enough). Such a weight is every head's: whole on each rank it
    does not fit the rank's heads, so it must be split by heads as its projection is."""
    owner = name.rpartition(".")[0]
    try:
        norm, attention = model.get_submodule(name), model.get_submodule(owner)
    except AttributeError:  # a name the model has not
        return ""
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() not in (1, 2):
        return ""
    d = weight.shape[-1] if weight.dim() == 2 else getattr(attention, "head_dim", 0)
    width = weight.numel()
    after = [s for s in split if s.rpartition(".")[0] == owner and getattr(model.get_submodule(s), "out_features",
                                                                             0) == width]
    after.sort(key=lambda s: s.rpartition(".")[2][0] != name.rpartition(".")[2][0])  # q_norm: q_proj first
    if not after or not isinstance(d, int) or d < 1 or width % d or width == d:
        return ""
    proj, heads = after[0].rpartition(".")[2], width // d
    try:  # one head's inputs scaled: a norm over the whole width changes every head's outputs
        x = torch.linspace(-2.0, 3.0, width, dtype=weight.dtype)
        with torch.no_grad():
            y, z = norm(x.view(1, *weight.shape)).flatten(), norm(x.index_fill(0, torch.arange(d), 50.0)
                                                                   .view(1, *weight.shape)).flatten()
        whole = not torch.allclose(y[d:], z[d:])
    except Exception:  # noqa: BLE001 - a norm that takes another shape, or is on the meta device
        return ""
    if whole:
        return (f"leaves {name}, a norm over all {heads} heads of {proj}'s output ({heads} x {d}), replicated: "
                f"tensor parallelism would need it split by heads like {proj} (each rank keeps its heads' part) "
                f"and its statistics summed over the ranks (or {proj}'s output gathered first), not its "
                "gradient summed")
    return (f"leaves {name}, a per-head norm ({heads} heads x {d}) after {proj}, replicated: tensor parallelism "
            f"would need it split by heads like {proj} (each rank keeps its heads' rows), not its gradient summed")
