"""model_parallel: the model's layers cut into K stages on K devices; one stage busy at a time.

    python scripts/model_parallel.py --devices cpu:2 [--balance time|params]

    time ->  stage 0: F . . B      (device 0 idle while device 1 works, and back)
             stage 1: . F B .

This is what to do when a model does not fit one device, done naively: the activations travel from
stage to stage, and every device waits while the others work, so the idle fraction is (p-1)/p. Its cost
over `single` is only the copies between devices; `pipeline` fills the idle time with micro-batches.
The stages are balanced by measured time (default) or by parameter count (--balance params): on the
CNN the convolutions hold few parameters but most of the work, so counting parameters unbalances it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.kit.stages import (
    Split,
    check_layers,
    given_cut,
    layers_of,
    split,
    stage_backward,
    stage_forward,
)
from parallel.kit.tensors import state_bytes
from parallel.kit.tied import copies as tie_copies
from parallel.measure import pipelines
from parallel.measure.stage_time import Watch
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.world.errors import ConfigError

NAME = "model_parallel"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    return setup_stages(model, make_optimizer, loss_fn, run, run.batch_size, run.options.balance)


def train_step(t: Trainable, batch, dist):
    sp, watch = t.state.split, t.state.watch
    x, y = batch
    last = len(sp.stages) - 1
    t.optimizer.zero_grad(set_to_none=True)
    watch.start_step()
    saved, h = [], x
    for s, (stage, device) in enumerate(zip(sp.stages, sp.devices, strict=True)):  # forward, stage by stage
        with watch.forward(s, 0):
            inp, h = stage_forward(stage, h, device, s == 0, watch.meters[s])
            if s == last:
                h = t.loss_fn(h, y.to(device))
        saved.append((inp, h))
    grad = None
    for s in reversed(range(len(sp.stages))):  # backward, last stage first
        if s < last and injected(t, NO_GRAD_BACK):
            break
        with watch.backward(s, 0):
            grad = stage_backward(*saved[s], grad)
    sp.sum_tied()  # a weight two stages use (GPT-2's head): its copies' gradients summed (tied.untie)
    t.optimizer.step()
    watch.end_step()
    return saved[last][1].detach()


@dataclass
class Stages:
    split: Split  # the stages and their devices
    watch: Watch  # each stage's busy time and activations, for the report (measure.pipelines)


def setup_stages(model, make_optimizer, loss_fn, run, sample_size: int, balance: str) -> Trainable:
    """Shared with `pipeline`: split the model over the devices, one device's share of the cores for the
    main thread (it runs or coordinates the stages)."""
    spec = run.spec
    devices = [spec.device(i) for i in range(run.world_size)]
    torch.set_num_threads(spec.threads_per_device())
    # The timing input: a batch of the workload's own data (images, or token ids for the transformer).
    sample = run.workload.dataset(run.seed, sample_size).batch(0)[0]
    sp = split(model, devices, balance, sample, given_cut(run, balance, len(devices), layers_of(model)))
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, devices[0],
                     state=Stages(sp, Watch(sp.stages, devices, run.warmup)),
                     devices=devices, grad_copies=tie_copies(sp.tied))


@dataclass
class Options:
    balance: str = field(default="time", metadata={"help": "split stages by measured 'time' or by 'params'"})

    def __post_init__(self):
        if self.balance not in ("time", "params"):
            raise ConfigError(f"--balance must be time or params, got {self.balance!r}")


# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
NO_GRAD_BACK = Mutant("model_parallel:no-grad-back", "the activations' gradient is never sent back to the "
                      "previous stage: the first stage never learns", {"workload": "cnn"})
MUTANTS = (NO_GRAD_BACK,)


def model_state_bytes(t: Trainable, run) -> list[int]:
    return [state_bytes(list(stage.parameters()), t.optimizer) for stage in t.state.split.stages]


def memory_layout(run, layout):
    return layout.replace(pp=layout.dp, dp=1)  # a stage a device (the planner's memory)


LAYERED = True  # cuts the model's pipeline_layers() into stages

MEASURE = pipelines.Threads(one_at_a_time=True)

HOOKS = Hooks(check=check_layers, model_state_bytes=model_state_bytes, memory_layout=memory_layout)
