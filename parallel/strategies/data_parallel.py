"""data_parallel: torch's nn.DataParallel, one process, one thread per GPU; a pass-through on CPU.

    python scripts/data_parallel.py --devices cuda:0,1      (on CPU it runs, and says it cannot help)

nn.DataParallel does what manual_dp does by hand, inside forward(): scatter, replicate,
parallel_apply, gather (torch/nn/parallel/data_parallel.py). With no CUDA device it just calls the
module (pytorch#3301, #7457): on `cpu:N` this row is `single` on one virtual device, labelled
"pass-through", so the report shows why it cannot help there.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.strategies.base import Trainable

NAME = "data_parallel"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def world_size(config) -> int:
    return config.world_size if config.spec.real else 1  # a pass-through uses one device


def device_kind(spec) -> str:
    return "real" if spec.real else "pass-through"


def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable:
    spec = config.spec
    model = model.to(spec.device(0))
    dp = nn.DataParallel(model, device_ids=list(spec.ids[: config.world_size]) if spec.real else None)
    devices = [spec.device(i) for i in range(world_size(config))]
    return Trainable(dp, make_optimizer(dp.parameters()), loss_fn, devices[0], devices=devices)


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # scattered inside forward()
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(t.model(x), y)  # the outputs are gathered on device_ids[0]
    loss.backward()
    t.optimizer.step()
    return loss.detach()


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in t.model.module.state_dict().items()}


def predict_step_ms(cal, config, row) -> float:
    n = world_size(config)  # 1 on CPU: a pass-through is one device's step
    return cal.compute_ms(-(-config.batch_size // n)) + cal.copy_ms(2 * (n - 1) * cal.grad_bytes)
