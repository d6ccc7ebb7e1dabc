"""What autograd saves for backward while a module runs forward: a stage's activation memory, counted
where it is made (the pipelines' stages, one tensor-parallel layer)."""

from __future__ import annotations

import torch
from torch import nn

from parallel.world.dist import local


class ActivationMeter:
    """Bytes autograd saves for backward while a stage runs forward (its activation memory), leaving
    out the parameters it also saves; of a DTensor, what this device holds. Use: `with meter: y = stage(x)`.
    Its hook costs a few percent of a stage's step (measured 1-4% on the CNN's pipeline), so the strategies
    switch it off (`active = False`) after the warm-up steps, as wire.Counter does: the bytes saved are
    the same at every step."""

    def __init__(self, stage: nn.Module):
        self.params = {local(p).data_ptr() for p in stage.parameters()}
        self.bytes = 0
        self.active = True
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._entered = False

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = local(t)
        if held.data_ptr() not in self.params:
            self.bytes += held.numel() * held.element_size()
        return t

    def __enter__(self):
        self._entered = self.active
        if self._entered:
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        if self._entered:
            self._hooks.__exit__(*exc)
