"""Weights that several pipeline stages use, kept in step: GPT-2's head is its token embedding, in the
first stage and the last. Megatron's rule: each stage holds its own copy, and after every backward the
copies' gradients are summed into all of them, so that every copy takes the step the one weight takes
on one device, and the copies stay equal.

    one process (model_parallel, pipeline)   untie the stages' modules; sum_tied after backward
    a process per stage (pipeline_dist)      TiedAcross: the same, plus an all-reduce among the ranks
                                             that hold a copy
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from parallel.loop import optim


def untie(modules: list[nn.Module]) -> list[list[nn.Parameter]]:
    """Megatron's rule for a weight that several stages use (GPT-2's head is its token embedding, in the
    first stage and the last): the first keeps it, every other gets its own copy, and after each backward
    the copies' gradients are summed into all of them (sum_tied). Each copy then takes the step the one
    weight takes on one device, and the copies stay equal. Returns each tied weight's copies, the
    original first (empty when nothing is shared). The modules' own attributes are replaced, so the
    model's state dict names both, with equal values."""
    users: dict[int, list[tuple[int, nn.Module, str]]] = {}
    for i, module in enumerate(modules):
        for owner in module.modules():
            for name, p in owner._parameters.items():
                if p is not None:
                    users.setdefault(id(p), []).append((i, owner, name))
    groups = []
    for places in users.values():
        if len({i for i, _, _ in places}) < 2:
            continue
        copies: dict[int, nn.Parameter] = {}
        for i, owner, name in places:
            p = owner._parameters[name]
            copies.setdefault(i, p if not copies else optim.like(nn.Parameter(p.detach().clone(), p.requires_grad), p))
            owner._parameters[name] = copies[i]
        groups.append(list(copies.values()))
    return groups


def copies(groups: list[list[nn.Parameter]]) -> dict[int, int]:
    """By id, every copy of each shared weight (untie's groups, all in one process) and their number."""
    return {id(p): len(group) for group in groups for p in group}


def sum_tied(groups: list[list[nn.Parameter]], reduce: Callable[[int, torch.Tensor], None] | None = None) -> None:
    """Each group's gradients summed (on the first copy's device) and given to every copy; `reduce(i, g)`,
    where given, adds other processes' copies of group i in place (pipeline_dist: an all-reduce)."""
    for i, group in enumerate(groups):
        home = group[0].device
        grads = [p.grad.to(home) for p in group if p.grad is not None]
        total = torch.stack(grads).sum(0) if grads else torch.zeros_like(group[0])
        if reduce is not None:
            reduce(i, total)
        for p in group:
            p.grad = total.to(p.device, copy=True)


class TiedAcross:
    """untie and sum_tied where the stages are processes (pipeline_dist): a weight the layers of several
    ranks use is summed over them by an all-reduce in a group of those ranks, after each backward. Made
    on every rank alike (the same model, the same cut: the groups are created in the same order)."""

    def __init__(self, layers: list[nn.Module], bounds: list[int], rank_of: Callable[[int], int],
                 modules: list[nn.Module], timeout: float):
        import bisect
        import datetime

        import torch.distributed as td

        users: dict[int, tuple[nn.Parameter, set[int]]] = {}
        for j, layer in enumerate(layers):
            for p in layer.parameters():
                users.setdefault(id(p), (p, set()))[1].add(j)
        local = {id(g[0]): g for g in untie(modules)}  # this rank's own copies, the original first
        here = {id(p) for m in modules for p in m.parameters()}
        self.groups: list[list[nn.Parameter]] = []  # this rank's copies of each shared weight ([]: none here)
        self.stages: list[int] = []  # how many stages hold a copy of each (one copy a stage)
        self.collectives: list = []  # the group of the ranks holding it (None: one rank)
        for p, js in users.values():
            if len(js) < 2:
                continue
            ranks = sorted({rank_of(bisect.bisect_right(bounds, j) - 1) for j in js})
            self.collectives.append(td.new_group(ranks, timeout=datetime.timedelta(seconds=timeout))
                                    if len(ranks) > 1 else None)
            self.groups.append(local.get(id(p)) or ([p] if id(p) in here else []))
            self.stages.append(len({bisect.bisect_right(bounds, j) - 1 for j in js}))

    def copies(self) -> dict[int, int]:
        """By id, this rank's copies of a shared weight and how many copies the world holds of it."""
        return {id(p): self.stages[i] for i in self.held() for p in self.groups[i]}

    def held(self) -> list[int]:
        """The shared weights this rank holds a copy of (their indices in `groups`)."""
        return [i for i, g in enumerate(self.groups) if g]

    def sum(self) -> None:
        """Every copy of each shared weight gets the sum of their gradients."""
        import torch.distributed as td

        held = self.held()

        def across(k: int, total: torch.Tensor) -> None:
            if (group := self.collectives[held[k]]) is not None:
                td.all_reduce(total, group=group)

        sum_tied([self.groups[i] for i in held], across)
