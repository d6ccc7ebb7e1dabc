"""data_parallel: torch's nn.DataParallel, one process, one thread per GPU; a pass-through on CPU.

    python scripts/data_parallel.py --devices cuda:0,1      (on CPU it runs, and says it cannot help)

nn.DataParallel does what manual_dp does by hand, inside forward(): scatter, replicate,
parallel_apply, gather (torch/nn/parallel/data_parallel.py). With no CUDA device it just calls the
module (pytorch#3301, #7457): on `cpu:N` this row is `single` on one virtual device, labelled
"pass-through", so the report shows why it cannot help there.

The devices are always given explicitly. `device_ids=None` means *every* visible GPU, so on a machine
with GPUs even `--devices cpu:2` would have nn.DataParallel take them all (and refuse the CPU module).
nn.DataParallel cannot be told "CPU" while CUDA is present (`device_ids=[]` fails, a CPU device is
refused), so on a CPU device list this strategy does explicitly what nn.DataParallel does without CUDA:
call the module.
"""

from __future__ import annotations

import torch
from torch import nn

from parallel.measure import replicas
from parallel.models.outputs import call, logits_of
from parallel.strategies.base import Hooks, Trainable
from parallel.world.devices import gpu_count

NAME = "data_parallel"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    spec = run.spec
    devices = [spec.device(i) for i in range(world_size(run))]
    model = model.to(devices[0])
    if spec.real:
        ids = [d.index for d in devices]
        dp = in_callers_autocast(nn.DataParallel(model, device_ids=ids, output_device=ids[0]))
    elif not gpu_count():  # no CUDA here: torch's own class, which then passes through
        dp = in_callers_autocast(nn.DataParallel(model))
    else:  # a CPU device list on a machine with GPUs: pass through explicitly
        dp = PassThrough(model)
    return Trainable(dp, make_optimizer(dp.parameters()), loss_fn, devices[0], devices=devices)


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # scattered inside forward()
    t.optimizer.zero_grad(set_to_none=True)
    # The outputs are gathered on device_ids[0]; a model's own losses would be one per replica, so the loss
    # is taken over the logits (the targets are scattered with the inputs: whole logits, outputs.call).
    loss = t.loss_fn(logits_of(call(t.model, x, y)), y)
    loss.backward()
    t.optimizer.step()
    return loss.detach()


class PassThrough(nn.Module):
    """nn.DataParallel's own behaviour without CUDA (data_parallel.py: `if not self.device_ids: return
    self.module(*inputs)`), on any machine."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)


def in_callers_autocast(dp: nn.Module) -> nn.Module:
    """Make nn.DataParallel's replicas compute in the caller's autocast dtype, not CUDA's default fp16.

    torch's parallel_apply (torch/nn/parallel/parallel_apply.py, `_worker`) re-enters autocast in each new
    thread as `torch.amp.autocast(device_type, enabled=autocast_enabled)`: no dtype, so it takes
    `torch.get_autocast_dtype(device_type)`, which is per thread and float16 on CUDA in a fresh thread. Under
    `--precision bf16` the replicas would run fp16 (with no loss scaling). Here each replica enters
    `torch.autocast` with the dtype read in the calling thread. Without autocast (fp32), or when
    nn.DataParallel just calls the module (no CUDA, one device), nothing changes; no global state is touched."""

    def parallel_apply(replicas, inputs, kwargs):
        device_type = dp.src_device_obj.type  # set by nn.DataParallel whenever it has device_ids
        if torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
            replicas = [_under_autocast(r, device_type, dtype) for r in replicas]
        return type(dp).parallel_apply(dp, replicas, inputs, kwargs)

    dp.parallel_apply = parallel_apply
    return dp


def _under_autocast(module: nn.Module, device_type: str, dtype: torch.dtype):
    def run(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            return module(*args, **kwargs)

    return run


def world_size(run) -> int:
    return run.world_size if run.spec.real else 1  # a pass-through uses one device


def device_kind(spec) -> str:
    return spec.kind_label if spec.real else "pass-through"


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in t.model.module.state_dict().items()}


def memory_layout(run, layout):
    return layout.replace(gathers_whole_batch=True)  # the first device holds the whole batch's logits


SENDS_SEEN = False  # its copies between devices happen inside nn.DataParallel, unseen: no bytes shown
LOGITS_LOSS = True  # the loss is taken over the gathered logits (a model's own loss: parallel/models/outputs.py)

# Its cost model's step (parallel/measure/replicas.py): a pass-through on CPU is one device's step; its copies are
# made inside torch, unseen by the loop's counter: no textbook bytes beside them.
MEASURE = replicas.Replicas(world_size, copies=False)

HOOKS = Hooks(world_size=world_size, device_kind=device_kind, state_dict=state_dict, memory_layout=memory_layout)
