"""manual_dp: data parallel inside one process, by hand: what nn.DataParallel does on every step.

    python scripts/manual_dp.py --devices cpu:2        (or cuda:0,1)

Every step, with the primitives of primitives.py (torch's own refuse CPU devices):

    scatter         the global batch (B, ...) -> one chunk per device
    replicate       the model -> one replica per device, parameters as differentiable copies
    parallel_apply  replica_i(chunk_i), one thread per device
    gather          outputs -> (B, C) on the first device, where the loss is taken
    backward        dloss/doutput split back to the replicas; each replica's backward in its own thread,
                    gradients summed into the original parameters through the copies
    optimizer       one step on the original parameters

Why backward runs in threads: on GPUs the autograd engine already runs each device's part of the
backward on a thread of its own. Virtual CPU devices share one engine thread, so a plain
loss.backward() would run the replicas' backward passes one after another (FIELD-NOTES measured
1.18x instead of 1.75x on the CNN). Splitting the gradient by hand gives the CPU what GPUs get for free.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from parallel.kit.primitives import DeviceThreads, gather, parallel_apply, replicate, scatter
from parallel.kit.tensors import param_bytes, state_bytes
from parallel.loop.timing import PhaseTimer
from parallel.measure import replicas
from parallel.models.outputs import call, keyword_of, logits_of
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.world.devices import IntervalClock

NAME = "manual_dp"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    spec = run.spec
    devices = [spec.device(i) for i in range(run.world_size)]
    # The main thread only coordinates (loss, optimizer), so it gets one device's share of the cores, not
    # all of them: after a parallel region OpenMP's idle threads keep spinning, on the very cores the
    # device threads need (measured on the CNN, cpu:2: a step took 36 ms with 2 main threads, 26 with 1).
    torch.set_num_threads(spec.threads_per_device())
    model = model.to(devices[0])  # the original parameters live on the output device
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, devices[0],
                     state=State(devices, DeviceThreads(devices, spec.threads_per_device()),
                                 param_bytes(model.parameters()), PhaseTimer(IntervalClock(devices))),
                     devices=devices)


def train_step(t: Trainable, batch, dist):
    devices, phase, pool = t.state.devices, t.state.phase, t.state.pool
    x, y = batch  # the global batch, (B, ...) and (B,)
    t.optimizer.zero_grad(set_to_none=True)
    phase.start_step()
    with phase("scatter"):
        xs = scatter(x, devices)  # [(B_i, ...)], B_i = ceil(B/N) but the last
    with phase("replicate"):
        replicas = t.state.kept or replicate(t.model, devices[: len(xs)])
        if injected(t, STALE_REPLICA):
            t.state.kept = replicas
    with phase("parallel_apply"):  # a model that takes its targets gets its chunk of them (outputs.call)
        ys = scatter(y, devices) if keyword_of(t.model) else [None] * len(xs)
        calls, pairs = [functools.partial(call, r) for r in replicas], list(zip(xs, ys, strict=True))
        outs = [logits_of(o) for o in parallel_apply(calls, pairs, devices, pool=pool)]  # [(B_i, C)] on device i
    with phase("gather"):
        out = gather(outs, devices[0])  # (B, C) on the output device
        loss = t.loss_fn(out, y.to(devices[0]))
    with phase("backward"):
        (grad_out,) = torch.autograd.grad(loss, out)  # (B, C): the loss's part of backward
        grads = scatter(grad_out, devices)  # what Gather.backward does: split it back to the replicas
        pairs = list(zip(outs, grads, strict=True))[: -1 if injected(t, REPLICA_GRAD_DROPPED) else None]
        parallel_apply([_backward] * len(pairs), pairs, devices, pool=pool)
    with phase("optimizer"):
        t.optimizer.step()
    phase.end_step()
    return loss.detach()


@dataclass
class State:
    devices: list[torch.device]
    pool: DeviceThreads  # a long-lived thread per device
    param_bytes: int  # what a replica copies
    phase: PhaseTimer  # where each step's time goes
    kept: list | None = None  # the replicas of the first step (only under STALE_REPLICA)


def _backward(output: torch.Tensor, grad: torch.Tensor) -> None:
    torch.autograd.backward(output, grad)


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
STALE_REPLICA = Mutant("manual_dp:stale-replica", "replicas made at the first step and kept: they go on "
                                                  "computing with the first step's weights", {"workload": "cnn"})
REPLICA_GRAD_DROPPED = Mutant("manual_dp:replica-grad-dropped", "the last replica's backward never runs: its "
                                                                "chunk adds no gradient", {"devices": "cpu:3"})
MUTANTS = (STALE_REPLICA, REPLICA_GRAD_DROPPED)


def model_state_bytes(t: Trainable, run) -> list[int]:
    """Device 0 holds the original parameters, their gradients and the optimiser state, and every device
    a replica's parameter copies for the length of a step."""
    copies = t.state.param_bytes
    return [state_bytes(list(t.model.parameters()), t.optimizer) + copies] + [copies] * (len(t.state.devices) - 1)


def memory_layout(run, layout):
    return layout.replace(gathers_whole_batch=True)  # the first device holds the whole batch's logits


LOGITS_LOSS = True  # the loss is taken over the gathered logits (a model's own loss: parallel/models/outputs.py)

# Its measurement (parallel/measure/replicas.py): where each timed step's time went, the bytes copied between the
# devices by the textbook, and the cost model's step.
MEASURE = replicas.Replicas(phases=lambda t: t.state.phase)

HOOKS = Hooks(model_state_bytes=model_state_bytes, memory_layout=memory_layout)
