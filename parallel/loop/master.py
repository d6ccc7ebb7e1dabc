"""--precision bf16-master (docs/optimizer.md): bf16 parameters and gradients, fp32 master weights and moments,
the mixed precision the ZeRO paper counts (2 + 2 + K bytes a parameter, K = 12 under Adam) and Megatron's
--bf16 and DeepSpeed's bf16 run. The model's parameters are cast to bf16 once, after the seed made them
(worker.py), and each step runs under the same bf16 autocast as --precision bf16 (losses and reductions in
fp32); backward leaves bf16 gradients, which the layout reduces in bf16, half fp32's bytes. Then

    before the step    the clip, on the bf16 gradients (loop/clipping.py; Megatron clips fp32 copies of them:
                       one more rounding here, the same in every layout)
    step               master.grad = fp32(p.grad); torch's update (AdamW, SGD, Muon) on the fp32 master
    after              p <- bf16(master), round to nearest: an update smaller than half a bf16 ulp of the
                       weight (2^-9 of it) moves the master, and the weight once the master has moved enough

`Master` is one torch Optimizer over the model's parameters, so that the clip hooks, the schedule and the
checkpoints see one; the master is its state "master" beside the moments, so that it is saved, sharded and
resumed wherever they are. Each rank keeps the master of what it steps: all of it under data parallelism,
its shard under FSDP2 and tensor parallelism, its chunks under ZeRO, its owned parameters under torch's
ZeroRedundancyOptimizer. The oracle judges the masters (`published`): the bf16 weights are their rounding,
and one rounding tipped the other way by another summation order is a whole bf16 ulp (2^-8 of a norm's
scale, 4e-3), far over any movement rule.
"""

from __future__ import annotations

import contextlib
import functools

import torch

from parallel.world.dist import is_dtensor, local

MASTER = "master"  # the optimiser state the fp32 master weight is kept under
DTYPE = torch.bfloat16


def cast(model: torch.nn.Module) -> None:
    """The model's floating parameters to bf16 in place (the same Parameter objects, their kinds kept); buffers
    stay as they are (positions, norms' statistics)."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(DTYPE)


@functools.cache
def of(inner: type[torch.optim.Optimizer]) -> type[torch.optim.Optimizer]:
    """`Master` over `inner`, as a class whose constructor takes what `inner`'s does (torch's
    ZeroRedundancyOptimizer builds its rank's own from a class)."""
    return type(f"Master{inner.__name__}", (Master,), {"INNER": inner})


class Master(torch.optim.Optimizer):
    """bf16 parameters, stepped through fp32 copies by INNER; `low` is the injected bug's switch (the master
    made in the parameter's own dtype, bf16)."""

    INNER: type[torch.optim.Optimizer] = torch.optim.AdamW

    def __init__(self, params, **defaults):
        super().__init__(params, defaults)
        self.low = False
        # the masters are made when first wanted (`master_of`): a state that holds masters alone is not fresh
        # to torch's DCP, which makes the moments by a step only where the state is empty. The inner
        # optimiser is built over stand-ins of the same shapes, on no device, to fill its settings
        stand_ins = [{**g, "params": [torch.empty(p.shape, device="meta") for p in g["params"]]}
                     for g in self.param_groups]
        inner = self.INNER(stand_ins, **defaults)
        for group, filled in zip(self.param_groups, inner.param_groups, strict=True):
            for k, v in filled.items():  # the inner optimiser's own settings (AdamW's foreach, ...), kept here
                if k != "params":
                    group.setdefault(k, v)
        self._inner = inner

    def _params(self):
        return [p for g in self.param_groups for p in g["params"]]

    def master_of(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 master, made from p the first time it is wanted (the first step, or a checkpoint's state
        before it); in bf16 under the injected bug."""
        if MASTER not in self.state[p]:
            master = p.detach().clone() if self.low else p.detach().float()
            for k, v in vars(p).items():  # its kind, and how Muon gathers its matrix (optim.py, muon.py)
                if k.startswith("_parallel"):
                    setattr(master, k, v)
            self.state[p][MASTER] = master
        return self.state[p][MASTER]

    def keep_in_bf16(self) -> None:
        """The injected bug: every master made in bf16 (set before the first step)."""
        self.low = True

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's load, which casts every floating state to its parameter's dtype (bf16 here), then the
        saved masters and moments put back in their own dtype (fp32)."""
        super().load_state_dict(state_dict)
        saved = [i for g in state_dict["param_groups"] for i in g["params"]]
        for i, p in zip(saved, self._params(), strict=True):
            for k, v in state_dict["state"].get(i, {}).items():
                if k != "step" and isinstance(v, torch.Tensor) and v.is_floating_point():
                    self.state[p][k] = v.detach().to(device=p.device).clone()

    def _inner_groups(self) -> list[dict]:
        return [{**g, "params": [self.master_of(p) for p in g["params"]]} for g in self.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        # the groups and state are this optimiser's (the schedule sets their lr; a load replaces the state)
        self._inner.param_groups = self._inner_groups()
        self._inner.state = type(self._inner.state)(dict)
        pairs = [(p, self.master_of(p)) for p in self._params()]
        for p, master in pairs:
            self._inner.state[master] = {k: v for k, v in self.state[p].items() if k != MASTER}
            master.grad = None if p.grad is None else p.grad.to(master.dtype)
        self._inner.step()
        for p, master in pairs:
            self.state[p].update(self._inner.state[master])
            master.grad = None
            local(p).copy_(local(master))  # round to nearest: the bf16 weight the next step computes with
        return None


def masters(optimizer) -> dict[int, torch.Tensor]:
    """Each parameter's master, by the parameter's id, of every Master among a Trainable's optimisers."""
    each = getattr(optimizer, "optimizers", {"": optimizer})
    each = {k: getattr(o, "optim", o) for k, o in each.items()}  # ZeroRedundancyOptimizer's own, for its rank
    return {id(p): o.master_of(p) for o in each.values() if isinstance(o, Master)
            for g in o.param_groups for p in g["params"]}


def _found(trainable) -> dict[int, torch.Tensor]:
    return masters(trainable.optimizer) if trainable is not None and trainable.optimizer is not None else {}


@contextlib.contextmanager
def published(trainable):
    """While the final state is read (worker.py): each plain parameter this rank steps holds its fp32 master,
    so that the strategy's own gather returns the masters. A strategy whose optimiser steps tensors of its
    own (zero's chunks) or only some parameters (zero_optimizer) gathers them itself, by `masters`; a
    DTensor's (whose dtype a swap of its data does not change, and which FSDP2 puts back before a state_dict)
    is gathered after, by `whole`."""
    found = _found(trainable)
    swapped = [(p, p.data) for p in trainable.model.parameters() if id(p) in found and not is_dtensor(p)]
    for p, _ in swapped:
        p.data = found[id(p)]
    try:
        yield
    finally:
        for p, data in swapped:
            p.data = data


def whole(trainable, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each DTensor parameter's master gathered whole in its place (a collective per DTensor, in
    the model's order on every rank), under the parameter's name; a name the state does not have (a
    pipeline stage's own) is the strategy's to map (pipeline_dist.state_dict)."""
    found = _found(trainable)
    named = [(n, p) for n, p in trainable.model.named_parameters() if id(p) in found and is_dtensor(p)]
    gathered = {n: found[id(p)].full_tensor().detach().cpu() for n, p in named}  # on every rank: the same calls
    return state | {n: v for n, v in gathered.items() if n in state}
