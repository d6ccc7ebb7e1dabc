"""Grouped-query attention split over more tensor-parallel ranks than it has kv heads: each kv head copied
to the ranks whose query heads read it, as inference engines and Megatron-style trainers do when tp is
larger than the kv heads.

Split by heads, rank r of tp holds query heads r H/tp .. (r+1) H/tp - 1. With kv heads K < tp (tp a
multiple of K, m = tp / K), all of them read kv head r // m, so that rank needs that one head's k and v.

    copied(model, tp)   before the split: k and v hold each head's rows m times over, so the usual
                        colwise split hands rank r a copy of head r // m (nothing else changes: the
                        attention repeats the one head to its H/tp query heads as before)
    sum_copies(...)     after backward: each copy's gradient holds only its own rank's query heads' share;
                        the m ranks of a head add theirs (one all-reduce in their group), so the copies
                        take the same step and stay equal
    one_copy(...)       the state dict with one copy of each head: the model's own shapes

A rank's copy is held alike by its head's m ranks (Trainable.held_by: what --check-replicas compares).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td
from torch import nn

from parallel.kit.collectives import sum_gradients
from parallel.loop import optim
from parallel.models.transformer import Attention


@dataclass
class Copies:
    """Which Linear layers (every attention's k and v) hold their heads `m` times, this rank's group (the
    ranks that hold the same head as it), and every group's ranks."""

    m: int
    names: tuple[str, ...]
    head_size: int
    group: object
    ranks: tuple[int, ...]


def kv_heads_below(model: nn.Module, tp: int) -> list[tuple[str, Attention, int]]:
    """(name, attention, kv heads) of every attention with fewer kv heads than tp."""
    return [(name, m, kv) for name, m in model.named_modules()
            if isinstance(m, Attention) and (kv := m.k.out_features // m.head_size) < tp]


def problem(model: nn.Module, tp: int, muon: bool = False) -> str | None:
    """Why the kv heads cannot be copied to tp ranks (tp not a multiple of them; Muon, whose gather of the
    copies would orthogonalise each head's rows tp / kv times over), or None."""
    for name, _, kv in kv_heads_below(model, tp):
        if muon:
            return (f"Muon orthogonalises whole matrices, and {name}'s {kv} kv heads would be copied to tp {tp} "
                    "ranks: not supported (loop/muon.py); --optimizer adamw, or tp at most the kv heads")
        if tp % kv:
            return f"tp {tp} is not a multiple of {name}'s {kv} kv heads (each rank must read one whole kv head)"
    return None


def copied(model: nn.Module, tp: int, rank: int) -> Copies | None:
    """Each kv head's rows of k and v repeated tp / kv times in place, and this rank's process group of
    the copies (every rank calls this: new_group is a collective); None where tp splits the kv heads."""
    below = kv_heads_below(model, tp)
    if not below:
        return None
    m = tp // below[0][2]
    if any(tp // kv != m for _, _, kv in below):
        raise ValueError("the attention layers differ in kv heads")
    for _, attention, _ in below:
        for linear in (attention.k, attention.v):
            _repeat_rows(linear, attention.head_size, m)
    groups = [tuple(range(g * m, (g + 1) * m)) for g in range(tp // m)]
    made = [td.new_group(list(ranks)) for ranks in groups]
    mine = rank // m
    return Copies(m, tuple(f"{name}.{p}" for name, _, _ in below for p in "kv"), below[0][1].head_size,
                  made[mine], groups[mine])


def _repeat_rows(linear: nn.Linear, head_size: int, m: int) -> None:
    """[head 0, head 1, ...] -> [head 0 x m, head 1 x m, ...] along the output features."""
    with torch.no_grad():
        for attr in ("weight", "bias"):
            if (p := getattr(linear, attr)) is not None:
                heads = p.reshape(-1, head_size, *p.shape[1:])
                repeated = nn.Parameter(heads.repeat_interleave(m, dim=0).reshape(-1, *p.shape[1:]))
                setattr(linear, attr, optim.like(repeated, p))
    linear.out_features *= m


def params(model: nn.Module, copies: Copies) -> list[nn.Parameter]:
    return [p for name in copies.names for p in model.get_submodule(name).parameters()]


def sum_copies(model: nn.Module, copies: Copies | None) -> None:
    """Every copy's gradient summed over the ranks of its head, in one flat all-reduce (what this rank
    holds of it: a DTensor's local shard)."""
    if copies is not None:
        sum_gradients(params(model, copies), 1, copies.group)


def one_copy(state: dict[str, torch.Tensor], copies: Copies | None) -> dict[str, torch.Tensor]:
    """The gathered state dict with each head's m copies made one again (the first of them)."""
    if copies is None:
        return state
    out = dict(state)
    for name in copies.names:
        for attr in ("weight", "bias"):
            if (t := state.get(f"{name}.{attr}")) is not None:
                heads = t.reshape(-1, copies.m, copies.head_size, *t.shape[1:])
                out[f"{name}.{attr}"] = heads[:, 0].reshape(-1, *t.shape[1:]).clone()
    return out


def held_by(copies: Copies | None) -> dict[str, tuple[int, ...]]:
    """The copies' parameter names, each with the ranks that hold the same copy as this one."""
    if copies is None:
        return {}
    return {f"{name}.{attr}": copies.ranks for name in copies.names for attr in ("weight", "bias")}


def grad_bytes(model: nn.Module, tp: int, element: int) -> float:
    """Bytes each rank sends in sum_copies, a ring over the m ranks of its head: 2(m-1)/m of its copies'
    gradients (one head's k and v rows in each attention layer)."""
    below = kv_heads_below(model, tp)
    if not below:
        return 0.0
    m = tp // below[0][2]
    rows = sum(2 * a.head_size * (a.k.in_features + (a.k.bias is not None)) for _, a, _ in below)
    return 2 * (m - 1) / m * rows * element


def describe(model: nn.Module, tp: int) -> str:
    """How tp ranks hold grouped-query attention's kv heads, for the report; "" without it."""
    attention = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if attention is None or attention.k.out_features == attention.q.out_features:
        return ""
    kv = attention.k.out_features // attention.head_size
    if kv < tp:
        return f"{kv} kv heads, each copied to {tp // kv} ranks (tp {tp}), their gradients summed there"
    return f"{kv} kv heads split, {kv // tp} a rank"
