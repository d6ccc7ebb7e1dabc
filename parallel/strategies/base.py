"""What every strategy shares: the Trainable it builds, and the defaults of the optional hooks."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from parallel.kit.collectives import every_rank
from parallel.kit.tensors import gathered_on_cpu, state_bytes
from parallel.loop import checkpoint
from parallel.loop.results import Rule
from parallel.models.usermodel import shape_model, workload_of
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError


class Run:
    """What a strategy is handed wherever it is asked about a run (setup, check, every hook): the run's
    RunConfig (each of its fields reads here too: run.batch_size, run.world_size, run.mutant), this
    strategy's Options typed (run.options; None for a strategy without any), the workload (run.workload;
    its name is run.config.workload), and the model on the meta device (run.meta_model, built once). The
    one place the strategies' options and workload are derived from the config (Strategy.run makes it)."""

    def __init__(self, config, options_cls=None):
        self.config = config
        self.options = options_of(options_cls, config) if options_cls is not None else None
        self.workload = workload_of(config)

    def __getattr__(self, name: str):  # reached only for names a Run does not have: the config's fields
        if name.startswith("__") or name == "config":  # copy and pickle look for these before __init__ ran
            raise AttributeError(name)
        return getattr(self.config, name)

    @property
    def meta_model(self) -> nn.Module:
        return shape_model(self.config)

    def __reduce__(self):  # to a spawned process (Hogwild's workers): the config and the Options class
        return Run, (self.config, type(self.options) if self.options is not None else None)

    def __repr__(self) -> str:
        return f"Run({self.config.workload}, {self.options})"


@dataclass
class Trainable:
    """What `setup` returns and `train_step` takes: the (wrapped, split, sharded...) model and its optimiser."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | OptimizerGroup
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    device: torch.device
    state: Any = None  # the strategy's own state: a small dataclass of its module (ddp.State, ...)
    devices: list[torch.device] = field(default_factory=list)  # every device this process drives, when
    #   more than `device`: the loop synchronizes them all before reading its clock (a pipeline's last
    #   stage, say, may still be running on device 1 when device 0 is done)
    mutant: str = ""  # the injected bug this run carries (--mutant; see Mutant), "" for none
    not_expected: str = ""  # why this run, as it went, cannot match `single` (tokens dropped), "" if it must
    held_by: dict[str, tuple[int, ...]] = field(default_factory=dict)  # by name, the ranks that hold the same
    #   copy of a tensor of `model` where its layout alone would say otherwise (--check-replicas; divergence.py;
    #   the global gradient norm counts each gradient once by it: loop/clipping.py)
    grad_copies: dict[int, int] = field(default_factory=dict)  # by id, the copies of a tied weight (GPT-2's head on
    #   the last stage, its embedding on the first) the world holds, each with their summed gradient: the
    #   global gradient norm counts it once (kit/tied.py, loop/clipping.py)
    clip_alone: bool = False  # (injected bugs only) the gradient norm from this rank's own gradients, never reduced

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
    shows: str = "oracle"  # what must name it: the oracle's verdict; "hang", the diagnosis of a hang
    #   (judge/hangs.py); "replicas", --check-replicas (divergence.py). judge/named.py says what counts.


# The run the clipping bugs show in: the transformer under SGD, clipped at a norm it exceeds every step (its
# norm is about 0.7), so that a wrong clip moves every parameter (AdamW's update is nearly blind to a gradient
# scaled alike every step: docs/optimizer.md); the norm each rank reports is judged too.
CLIPPED = {"workload": "transformer", "optimizer": "sgd", "clip_norm": 0.25}
# The step's other bugs, under what users run: AdamW, warm-up and cosine decay.
ADAMW = {"workload": "transformer", "optimizer": "adamw", "lr_schedule": "cosine", "warmup_steps": 4}
MUON = {"workload": "transformer", "optimizer": "muon"}  # Muon on the matrices (loop/muon.py)


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


@dataclass(frozen=True)
class MemoryLayout:
    """How a strategy lays the model and the batch over its devices, what the planner needs to predict the
    memory of the busiest one (plan/local.py: the report's "Memory per device", --memory-cap): the answer
    of its `memory_layout` hook."""

    dp: int = 1  # replicas, each its own share of the batch
    tp: int = 1  # ranks a layer's weights are split over
    cp: int = 1  # ranks a sequence is split over
    pp: int = 1  # pipeline stages
    ep: int = 1  # ranks the routed experts are split over
    microbatches: int = 1  # micro-batches a stage's share is cut into (a pipeline's m)
    schedule: str = "1f1b"  # the pipeline's schedule: gpipe holds every micro-batch's activations
    zero_stage: int = 0  # 1: optimizer state sharded, 2: gradients too, 3: parameters too (FSDP)
    shards: int = 0  # ranks the ZeRO shards span; 0: dp x cp
    offloaded: bool = False  # model state kept on the host (FSDP's offload), none on the device
    accum: int = 1  # micro-batches a rank accumulates per optimizer step (no_sync)
    gathers_whole_batch: bool = False  # one device gathers every replica's output: the whole batch's logits
    splits: bool = False  # it cuts the model or its sequences (TENSOR_PARALLEL, LAYERED, SEQUENCE, EXPERTS): the
    #   planner counts it for the project's transformer only, and --memory-cap does not check it

    @classmethod
    def of(cls, dims: ParallelDims, splits: bool) -> MemoryLayout:
        """The layout of processes laid out by `dims`, each dp rank a whole replica: the default."""
        return cls(dp=dims.dp, tp=dims.tp, cp=dims.cp, pp=dims.pp, splits=splits)

    def replace(self, **changes) -> MemoryLayout:
        return dataclasses.replace(self, **changes)


def memory_layout(config, layout: MemoryLayout) -> MemoryLayout | None:
    """How the strategy lays out the model for the planner's memory per device, from `layout`, the default:
    MemoryLayout.of its processes' dims (ParallelDims.data_parallel(world_size) for a strategy that drives
    its devices from one process), each dp rank a whole replica; None where the planner has nothing to say."""
    return layout


def tolerance(config) -> Rule | None:
    """The strategy's own equivalence rule for this config, where it casts on its own what `single` does
    not (a stated tolerance, with what it rests on); None: the oracle's rule for the run's precision."""
    return None






def options_of(options_cls, config):
    """A strategy's typed Options from config.options, ignoring other strategies' flags (Strategy.run hands
    them to the strategy as run.options)."""
    names = {f.name for f in dataclasses.fields(options_cls)}
    return options_cls(**{k: v for k, v in config.options.items() if k in names})


def check_beside_dp(config, flag: str, size: int, alone: str) -> int:
    """A 2-D layout's second dimension (`--{flag} size`) beside data parallelism: it must divide the devices
    into data-parallel groups of at least 2, each of which the global batch divides into. Returns dp."""
    n = config.world_size
    if n % size or size == n:
        raise ConfigError(f"--{flag} {size} must divide the {n} devices into data-parallel groups of at least 2 "
                          f"({flag} x dp = {n}; {flag} alone is `{alone}`)")
    config.check_divisible(n // size, "data-parallel size")
    return n // size


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
    tolerance: Callable = tolerance
    checkpoint_state: Callable = checkpoint.state  # what a checkpoint holds (model, optimisers, step) ...
    restore_checkpoint: Callable = checkpoint.restore  # ... and how it goes back in after a load
    model_state_bytes: Callable = model_state_bytes
    train: Callable | None = None  # None: THE loop (parallel.loop.train.train); Hogwild brings its own
    memory_layout: Callable = memory_layout


def full_state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """A `state_dict` for models of DTensor shards (FSDP2, tensor parallel): the whole model under its plain
    names, on CPU, by torch's get_model_state_dict(full_state_dict=True), a collective; rank 0 gets them."""
    import torch.distributed as td
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if t.device.type == "cuda" and td.get_backend() == "gloo":  # ranks sharing one GPU (cuda:0x2)
        return gathered_on_cpu(t.model)
    sd = get_model_state_dict(t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.detach().cpu().clone() for k, v in sd.items()}
