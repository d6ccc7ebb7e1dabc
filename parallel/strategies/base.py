"""What every strategy shares: the Trainable it builds, and the defaults of the optional hooks."""

from __future__ import annotations

import collections
import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallel import checkpoint
from parallel.formulas import wire_bytes
from parallel.layout import ParallelDims
from parallel.results import Rule


@dataclass
class Trainable:
    """What `setup` returns and `train_step` takes: the (wrapped, split, sharded...) model and its optimiser."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | OptimizerGroup
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    comm_bytes: int | None = None  # bytes this rank sent through collectives so far; None: not counted
    comm_steps: int | None = None  # how many steps comm_bytes covers (wire.Counter); None: every step run
    state: Any = None  # the strategy's own state: a small dataclass of its module (ddp.State, ...)
    devices: list[torch.device] = field(default_factory=list)  # every device this process drives, when
    #   more than `device`: the loop synchronizes them all before reading its clock (a pipeline's last
    #   stage, say, may still be running on device 1 when device 0 is done)
    mutant: str = ""  # the injected bug this run carries (--mutant; see Mutant), "" for none
    not_expected: str = ""  # why this run, as it went, cannot match `single` (tokens dropped), "" if it must

    def all_devices(self) -> list[torch.device]:
        return self.devices or [self.device]


class OptimizerGroup:
    """Several optimisers that the loop, checkpoints and memory counts treat as one (the DCGAN's)."""

    def __init__(self, optimizers: dict[str, torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def state(self) -> collections.ChainMap:  # built each time: load_state_dict replaces each optimiser's dict
        return collections.ChainMap(*(o.state for o in self.optimizers.values()))

    def __getitem__(self, name: str) -> torch.optim.Optimizer:
        return self.optimizers[name]

    def state_dict(self) -> dict:
        return {k: o.state_dict() for k, o in self.optimizers.items()}

    def load_state_dict(self, state: dict) -> None:
        for k, o in self.optimizers.items():
            o.load_state_dict(state[k])


def make_optimizers(model: nn.Module, make_optimizer):
    """One optimiser for the model, or one per part for a model that has parts (the DCGAN)."""
    if not hasattr(model, "parts"):
        return make_optimizer(model.parameters())
    return OptimizerGroup({k: make_optimizer(m.parameters()) for k, m in model.parts().items()})


@dataclass(frozen=True)
class Mutant:
    """A small, realistic bug a strategy can be run with, through the documented switch `--mutant NAME`
    (RunConfig.mutant), never by editing files: the evidence that the oracle catches what it must. Each
    strategy lists its own in MUTANTS and tests `injected(config_or_trainable, MUTANT)` where the bug
    goes; `python -m parallel mutants` runs them all and shows the oracle's verdict on each."""

    name: str  # "<strategy>:<bug>"
    bug: str  # what is wrong, in one line
    run: dict = field(default_factory=dict, hash=False)  # the run it shows in: RunConfig fields, "options"


def injected(holder, mutant: Mutant) -> bool:
    """Is `mutant` switched on? `holder`: the RunConfig (in setup) or the Trainable (in train_step)."""
    return holder.mutant == mutant.name


def world_size(config) -> int:
    """Devices this strategy uses: by default every device of the run."""
    return config.world_size


def dims(config, dist) -> ParallelDims:
    """How this strategy lays out its processes: by default each one a data-parallel replica (a world of
    one for the in-process strategies, which drive all their devices from one process). The loop asks
    it which share of the global batch a rank takes and whose losses make the step's loss."""
    return ParallelDims.data_parallel(dist.world_size)


def available(spec) -> str | None:
    """None if the strategy can run on these devices, else the one-line reason it cannot."""
    return None


def check(config) -> None:
    """Raise ConfigError when the strategy cannot run this config (e.g. an indivisible batch)."""


def defaults(config) -> dict:
    """Option values fitted to this config, for the options the user did not give (a pipeline's
    micro-batches: at least one per stage, dividing the batch); {}: the Options' own defaults."""
    return {}


def device_kind(spec) -> str:
    """What the row's numbers mean: "real" GPUs, one GPU "shared" by several ranks, "virtual" CPU devices,
    or a "pass-through"."""
    return spec.kind_label


def state_dict(trainable: Trainable) -> dict[str, torch.Tensor]:
    """The final parameters and buffers on CPU, under the unwrapped model's names."""
    return {k: v.detach().cpu().clone() for k, v in trainable.model.state_dict().items()}


def comm_bytes_predicted(model: nn.Module, config) -> int | None:
    """Textbook bytes a rank sends per step; None where no prediction is offered."""
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """What this device really holds of `t`: a DTensor's local shard (a DTensor's numel() is the global
    size), else the tensor itself. (A tensor can be a DTensor only once torch.distributed.tensor is
    imported; not importing it here saves every process about 0.5 s of start-up.)"""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return t.to_local() if dtensor is not None and isinstance(t, dtensor.DTensor) else t


def tensor_bytes(t: torch.Tensor, allocated: bool = False) -> int:
    """Bytes of what this device holds of `t`: logical (elements x size), or allocated (the storage,
    padding of an uneven shard included)."""
    t = local(t)
    return t.untyped_storage().nbytes() if allocated else t.numel() * t.element_size()


def param_bytes(params, allocated: bool = False) -> int:
    return sum(tensor_bytes(p, allocated) for p in params)


def optimizer_state_bytes(params, optimizer, allocated: bool = False) -> int:
    """The optimiser's state for `params` (momentum, ...) that this device holds."""
    return sum(tensor_bytes(v, allocated) for p in params for v in optimizer.state.get(p, {}).values()
               if isinstance(v, torch.Tensor))


def state_bytes(params, optimizer, allocated: bool = False) -> int:
    """Parameters + their gradients + the optimiser's state for them (momentum, ...), counted from the
    tensors this device holds (local shards of DTensors)."""
    params = list(params)
    total = sum(tensor_bytes(p, allocated) + (tensor_bytes(p.grad, allocated) if p.grad is not None else 0)
                for p in params)
    return total + (optimizer_state_bytes(params, optimizer, allocated) if optimizer is not None else 0)


def every_rank(value) -> list:
    """`value` from every rank of the process group, in rank order (a collective: every rank calls it);
    [value] in a world of one."""
    import torch.distributed as td

    if not td.is_initialized() or td.get_world_size() == 1:
        return [value]
    out = [None] * td.get_world_size()
    td.all_gather_object(out, value)
    return out


def full_state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """A `state_dict` for models of DTensor shards (FSDP2, tensor parallel): the whole model under its plain
    names, on CPU, by torch's get_model_state_dict(full_state_dict=True), a collective; rank 0 gets them."""
    import torch.distributed as td
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if t.device.type == "cuda" and td.get_backend() == "gloo":  # ranks sharing one GPU (cuda:0x2)
        return gathered_on_cpu(t.model)
    sd = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}


def gathered_on_cpu(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU, each DTensor's local shard moved to the CPU first and gathered there
    (a collective, every rank in the same order). For gloo with CUDA tensors, where DTensor's own gather
    (torch's functional collectives) crashes the process: SIGSEGV in redistribute, seen on an H200 with
    two ranks sharing it (torch 2.11); gloo gathers CPU tensors the way every CPU run does."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    meshes: dict = {}
    out = {}
    for name, v in model.state_dict().items():
        if isinstance(v, DTensor):
            mesh = v.device_mesh
            if mesh not in meshes:  # the same ranks, on the CPU (a 1-D mesh of the world uses the default group)
                meshes[mesh] = DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
            v = DTensor.from_local(v.to_local().detach().cpu(), meshes[mesh], v.placements, run_check=False,
                                   shape=v.shape, stride=v.stride()).full_tensor()
        out[name] = v.detach().cpu().clone()
    return out


def model_state_every_rank(t: Trainable, config) -> list[int]:
    """A `model_state_bytes` for strategies whose ranks hold different parts: parameters, gradients and
    optimiser state counted from each rank's own tensors (local shards), gathered from every rank."""
    return every_rank(state_bytes(list(t.model.parameters()), t.optimizer))


def loaded_in_place(t: Trainable, sd: dict) -> None:
    """A `restore_checkpoint` for a `checkpoint_state` made of the live tensors themselves (the model's
    parameters, the optimiser's buffers): DCP has loaded into them, nothing is left to do."""


def model_state_bytes(t: Trainable, config) -> list[int]:
    """Model state per device: by default each device this process drives holds the whole model."""
    model = getattr(t.model, "module", t.model)
    return [state_bytes(list(model.parameters()), t.optimizer)] * len(t.all_devices())


def tolerance(config) -> Rule | None:
    """The strategy's own equivalence rule for this config, where it casts on its own what `single` does
    not (a stated tolerance, with what it rests on); None: the oracle's rule for the run's precision."""
    return None


def predict_step_ms(cal, config, row) -> float | None:
    """The cost model's step time for this strategy (harness/costmodel.py); None: no formula."""
    return None


def extra_measurements(trainable: Trainable, data, config, dist, result) -> dict:
    """Measurements beyond the loop's, taken after the final parameters are saved (they may train
    further), e.g. DDP's step time without communication. Stored in the row's `details`, except the
    declared ones, given as {"measured": results.Measured(...)}, which go to the row's `measured`."""
    return {}


def sum_gradients(params, divide_by: int, group=None) -> None:
    """The gradients of `params` summed over `group` (None: every rank) in one flat all-reduce, then divided
    by `divide_by` (the ranks whose mean losses make the step's: context and expert parallelism). A
    parameter with no gradient this step (an expert no row reached, a router whose gates were unused)
    counts as zero, so every rank sends the same flat tensor."""
    import torch.distributed as td

    params = list(params)
    if not params:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    td.all_reduce(flat, group=group)
    flat /= divide_by
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def ring_allreduce_bytes(payload_bytes: float, world: int) -> float:
    """Bytes each rank sends to all-reduce `payload_bytes` with a ring: reduce-scatter then all-gather,
    each moving (N-1)/N of the payload (the nccl-tests busbw convention; the planner's formulas.wire_bytes)."""
    return wire_bytes("all_reduce", payload_bytes, world)


def options_of(options_cls, config):
    """A strategy's typed Options from config.options, ignoring other strategies' flags."""
    names = {f.name for f in dataclasses.fields(options_cls)}
    return options_cls(**{k: v for k, v in config.options.items() if k in names})


def grad_bytes(model: nn.Module) -> int:
    return param_bytes(p for p in model.parameters() if p.requires_grad)


def allreduce_every_gradient(model: nn.Module, config) -> float:
    """Data parallel's textbook bytes a rank sends per step (ddp, manual_ddp): every gradient all-reduced
    once, with a ring."""
    return ring_allreduce_bytes(grad_bytes(model), config.world_size)


def predict_data_parallel_ms(cal, config, accum: int) -> float | None:
    """Data parallel (ddp, manual_ddp): each rank computes its share (in `accum` pieces) and all-reduces
    every gradient once a step.
    - gloo on CPU: the all-reduce cannot hide behind compute (the ranks' threads already use every
      core), so it is added whole.
    - nccl: the buckets all-reduce on their own stream while backward goes on, so only what outlasts the
      last micro-batch's backward shows (backward is about two thirds of a step's arithmetic, twice the
      forward's), and never less than the last bucket's all-reduce, which starts when backward ends
      (the first layers' bucket; DDP's is 1 MiB)."""
    n = config.world_size
    comm = cal.allreduce_ms(cal.grad_bytes, n)
    if comm is None:
        return None
    micro = cal.compute_ms(config.batch_size // (n * accum))
    if not cal.overlaps:
        return accum * micro + comm
    return accum * micro + max(comm - 2 / 3 * micro, cal.allreduce_ms(min(cal.grad_bytes, 2**20), n))


def predict_sharded_ms(cal, config, row, all_gathers: int) -> float | None:
    """Sharded data parallel (zero, fsdp): each rank computes its share, then one reduce-scatter of the
    gradients and `all_gathers` all-gathers of the parameters, none hidden (they block in or after
    backward here; FSDP2's prefetch on GPUs would hide some: an upper bound there). The collectives' times
    are the row's own, measured in this run (wire.timed_collectives: on gloo a reduce-scatter costs about
    an all-reduce); without them, from the all-reduce calibration: an all-gather or an nccl reduce-scatter
    is half an all-reduce's traffic, gloo's reduce-scatter a whole one (PR #118911)."""
    m, n = row.measured, config.world_size
    if m.reduce_scatter_all_grads_ms is not None and m.all_gather_all_params_ms is not None:
        comm = m.reduce_scatter_all_grads_ms + all_gathers * m.all_gather_all_params_ms
    else:
        allreduce = cal.allreduce_ms(cal.grad_bytes, n)
        if allreduce is None:
            return None
        comm = (allreduce / 2 if cal.overlaps else allreduce) + all_gathers * allreduce / 2
    return cal.compute_ms(config.batch_size // n) + comm


@dataclass(frozen=True)
class Hooks:
    """A strategy's optional parts, each defaulting to the function above. A strategy module lists the
    ones it overrides, `HOOKS = Hooks(check=check, ...)`, and nothing else in it is a hook, whatever its
    name: a helper imported from another strategy cannot become one by accident."""

    available: Callable = available
    world_size: Callable = world_size
    dims: Callable = dims
    check: Callable = check
    defaults: Callable = defaults
    device_kind: Callable = device_kind
    state_dict: Callable = state_dict
    comm_bytes_predicted: Callable = comm_bytes_predicted
    extra_measurements: Callable = extra_measurements
    predict_step_ms: Callable = predict_step_ms
    tolerance: Callable = tolerance
    checkpoint_state: Callable = checkpoint.state  # what a checkpoint holds (model, optimisers, step) ...
    restore_checkpoint: Callable = checkpoint.restore  # ... and how it goes back in after a load
    model_state_bytes: Callable = model_state_bytes
    train: Callable | None = None  # None: THE loop (parallel.train.train); Hogwild brings its own
