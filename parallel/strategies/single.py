"""single: plain training on one device, the reference every other strategy is checked against.

On `cpu:N` it runs on ONE virtual device (its share of the cores), so speedups in the report are
against one device of the same list. Every other strategy reads as a small diff from this file.
"""

from __future__ import annotations

from parallel.measure import replicas
from parallel.models.outputs import call
from parallel.strategies.base import Hooks, Trainable, make_optimizers

NAME = "single"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    model = model.to(dist.device)
    return Trainable(model, make_optimizers(model, make_optimizer), loss_fn, dist.device)


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # (B, ...) and (B,)
    if hasattr(t.model, "parts"):  # two models, two optimisers, two losses: the model's own update
        return t.model.update(t.model.parts(), t.optimizer, x, y)
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()
    t.optimizer.step()
    return loss.detach()


def world_size(run) -> int:
    return 1


LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)
MULTI_PART = True  # also trains models with separately optimised parts (the DCGAN)
ROUTING = True  # one process: a router's counts are the whole batch's (trains with --aux-loss)

MEASURE = replicas.Replicas(world_size)  # one replica: the step's compute, nothing sent (parallel/measure/replicas.py)

HOOKS = Hooks(world_size=world_size)
