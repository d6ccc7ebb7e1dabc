"""RunConfig: every knob a comparison has, validated in one place with messages that name the numbers."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from parallel.loop import muon
from parallel.loop.optim import OPTIMIZERS, SCHEDULES, resolve
from parallel.models import userdata, userload, usermodel
from parallel.models.transformer import SHAPE
from parallel.models.workloads import WORKLOADS
from parallel.world.devicespec import DeviceSpec, parse_devices
from parallel.world.errors import ConfigError

__all__ = ["ConfigError", "RunConfig"]

PRECISIONS = ("fp32", "bf16", "bf16-master", "fp64")


def _number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def nearest_multiple(value: int, of: int) -> int:
    """The multiple of `of` nearest to `value` (the larger one on a tie), at least `of`."""
    return max(of, (value + of // 2) // of * of)


@dataclass
class RunConfig:
    workload: str = "cnn"  # a built-in one; with `model`, the model's label (set by validate)
    # Your own model (parallel/models/usermodel.py): FILE.py:FACTORY or module:FACTORY, and its data: input_shape
    # ("3,32,32") and classes, vocab and seq_len (tokens), or data (a .pt or .npz file of x and y).
    model: str = ""
    input_shape: str = ""
    classes: int = 0
    vocab: int = 0
    seq_len: int = 0
    data: str = ""
    aux_loss: float = 0.0  # the MoE's load-balancing loss weight (0: off); a workload with experts only
    tokens: str = "even"  # token batches: "even" (every position a target) or "padded" (documents of drawn
    #   lengths, padding left out of the loss: uneven real tokens per rank; docs/loss.md)
    # The built-in transformer's shape, as `plan` takes it (transformer.shaped; 0 or "": its own), with vocab
    # and seq_len above; `preset` only names the shape the CLI filled these from (plan/models.PRESETS).
    preset: str = ""
    arch: str = ""
    layers: int = 0
    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    ffn: int = 0
    tied: bool = False
    why: str = ""  # why this workload, where the CLI chose it (GPUs and no workload named: cliargs.GPU_DEFAULT)
    batch_size: int = 512  # the GLOBAL batch: every strategy takes one optimiser step on this many samples
    batch_auto: bool = False  # batch_size is a default, not the user's: validate rounds it to the nearest
    #   multiple of the world size (3 devices: 513), so that every rank takes an equal share
    steps: int = 20  # timed optimiser steps
    warmup: int = 3  # optimiser steps before the timed ones (they train too, they are just not timed)
    # The optimiser step (loop/optim.py, docs/optimizer.md); None or "": the chosen optimiser's default, filled
    # in by validate (AdamW where a transformer trains, SGD elsewhere)
    optimizer: str = ""
    lr: float | None = None
    momentum: float = 0.9  # SGD's
    weight_decay: float | None = None
    betas: str = "0.9,0.95"  # AdamW's
    clip_norm: float | None = None  # the global gradient norm clipped to this (0: no clip)
    lr_schedule: str = "constant"  # or "cosine", after warmup_steps of linear warm-up
    warmup_steps: int = 0  # the learning rate's warm-up (not --warmup, the untimed steps)
    seed: int = 0
    devices: str = "auto"
    world_size: int = 0  # 0: one per device in `devices`
    precision: str = "fp32"  # "bf16": every strategy's steps under torch.autocast(bfloat16), `single`'s too;
    #                          "bf16-master": bf16 parameters and gradients, fp32 master weights (loop/master.py);
    #                          "fp64": the model, its data and every buffer in float64 (the oracle's sharp check)
    profile: bool = False
    repeat: int = 1  # rounds of the whole list, interleaved (single, a, b, ..., then again); speedups paired
    out: str = ""  # "" -> results/run-<time>
    timeout: float = 300.0  # seconds one strategy may take, start-up included
    pg_timeout: float = 60.0  # seconds a collective may wait before the process group gives up
    port: int = 0  # rendezvous port on 127.0.0.1 for torchrun strategies; 0: any free port
    max_restarts: int = 0  # torchrun --max-restarts for the harness's launches
    checkpoint_every: int = 0  # save model + optimiser every K steps and at the end (0: never)
    resume: bool = False  # continue from OUT/checkpoints/<strategy>/ if it exists (what a restart uses)
    resume_from: str = ""  # continue from this checkpoint; it must exist
    memory_cap_mb: float = 0.0  # MiB a device may hold (0: no cap): the planner refuses, CUDA's allocator enforces
    memory_snapshot: str = ""  # a strategy whose last warm-up step's CUDA allocations go to OUT/memory/ (memory_viz)
    fail_at_step: int = -1  # for demos and tests: raise in the training loop at this step ...
    fail_rank: int = 0  # ... on this rank (or Hogwild worker); only in torchrun's first attempt
    hang_rank: int = -1  # for demos and tests: this rank stops at its first gradient collective of step 1
    hang_how: str = "stop"  # ... and there stops responding ("stop"), or kills itself with SIGKILL ("kill")
    debug_collectives: bool = False  # TORCH_DISTRIBUTED_DEBUG=DETAIL: every collective's fingerprint checked
    check_replicas: bool = False  # after every step, checksums of what ranks must hold alike (divergence.py)
    mutant: str = ""  # for testing the oracle: run with this injected bug (`python -m parallel mutants --list`)
    extras: bool = True  # the strategy's own measurements after training (exposed communication, collectives
    #   timed, ...); the oracle's runs leave them out: they judge the parameters and losses only
    # Strategies' own knobs by flag name (e.g. {"accum": 2}); each strategy's Options types and checks
    # its own. A list is a sweep: one variant (one report row) per value.
    options: dict = field(default_factory=dict)
    # Stage cuts decided in this run, "<balance>:<stages>" -> bounds: the first pipeline row measures and
    # cuts, and every later one of the run takes the same cut, so their idle columns compare one split.
    cuts: dict = field(default_factory=dict)
    # > 0: train the shallow twin of the model, this many blocks (same widths, vocabulary and options), not
    # the model itself: what `single` and each strategy's verdict run on when `single` does not fit one
    # device (judge/twin.py); set by the planner, never a flag
    twin_blocks: int = 0
    # Why the parent's check of this strategy ran on a real copy of the user's model (the meta device refused
    # it: the error), "" where it did not; set by compare.select_runs, never a flag, said in the row's details
    real_copy: str = ""

    def validate(self) -> RunConfig:
        """Check every field and resolve `devices` and `world_size`; returns the resolved copy, its `spec`
        the one parse made here."""
        user = {}
        if self.data and not Path(self.data).expanduser().is_file():
            raise ConfigError(f"--data {self.data}: no such file")
        if self.model and self.aux_loss:
            raise ConfigError("--aux-loss weights the built-in moe workload's load-balancing loss; your model's "
                              "parallel.models.moe.MoE layers carry their own (MoE(..., aux_weight=w))")
        if self.model:  # imported, built twice, one forward on a sample: every mistake found here
            user = {"model": userload.resolve_factory(self.model),
                    "data": str(Path(self.data).expanduser().resolve()) if self.data else ""}
            if user["data"]:  # before the model is tried on it
                userdata.check_batch(user["data"], self.batch_size, self.vocab, self.seq_len)
            user["workload"] = usermodel.workload_of(dataclasses.replace(self, **user)).name
        elif self.workload not in WORKLOADS:
            raise ConfigError(f"unknown workload {self.workload!r}; choose from {', '.join(WORKLOADS)}")
        elif self.input_shape or self.classes or self.data:
            raise ConfigError("--input-shape, --classes and --data describe the data of your own model: give "
                              "--model FILE.py:FACTORY too")
        elif self.seq_len or self.aux_loss or self.vocab or self.shaped or self.twin_blocks or self.tokens != "even":
            usermodel.workload_of(self)  # the built-in transformer's shape, twin; refused for a workload without one
        if self.model and self.shaped:
            raise ConfigError("--preset, --arch, --layers, --hidden, --heads, --kv-heads, --ffn and --tied shape the "
                              "built-in transformer; your model has its own shape")
        for name in ("batch_size", "steps"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ConfigError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.seed < 0:
            raise ConfigError(f"--seed must be 0 or more, got {self.seed}")
        recipe = self.check_recipe(user)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not (math.isfinite(self.memory_cap_mb) and self.memory_cap_mb >= 0):
            raise ConfigError(f"--memory-cap must be 0 (none) or a positive number of MiB, got {self.memory_cap_mb}")
        if not (0 <= self.momentum < 1):
            raise ConfigError(f"momentum must be in [0, 1), got {self.momentum}")
        for name in ("timeout", "pg_timeout"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive number of seconds, got {value}")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"--port must be 0 (any free port) or 1..65535, got {self.port}")
        if self.checkpoint_every < 0:
            raise ConfigError(f"--checkpoint-every must be 0 (never) or more, got {self.checkpoint_every}")
        if self.repeat < 1:
            raise ConfigError(f"--repeat must be at least 1 (rounds of every strategy), got {self.repeat}")
        if self.repeat > 1 and (self.checkpoint_every or self.resume or self.resume_from or self.fail_at_step >= 0
                                or self.hang_rank >= 0):
            raise ConfigError("--repeat times the same run again; it does not combine with checkpoints, --resume "
                              "or injected faults")
        if self.hang_how not in ("stop", "kill"):
            raise ConfigError(f"--hang-how must be stop or kill, got {self.hang_how!r}")
        if self.hang_rank >= 0 and self.warmup + self.steps < 2:
            raise ConfigError(f"--hang-rank stops its rank in step 1, and this run has {self.warmup + self.steps} "
                              f"step (--warmup + --steps must be 2 or more)")
        if self.twin_blocks < 0:
            raise ConfigError(f"twin_blocks must be 0 (the model itself) or a number of blocks, got {self.twin_blocks}")
        if self.max_restarts < 0:
            raise ConfigError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        spec = self.spec
        world = self.world_size or spec.count
        if world < 1:
            raise ConfigError(f"--world-size must be at least 1, got {self.world_size}")
        if world > spec.count:
            raise ConfigError(f"--world-size {world} is more than the {spec.count} device(s) of {spec}")
        batch = nearest_multiple(self.batch_size, world) if self.batch_auto else self.batch_size
        if user.get("data") and batch != self.batch_size:
            userdata.check_batch(user["data"], batch, self.vocab, self.seq_len)
        resolved = dataclasses.replace(self, devices=str(spec), world_size=world, batch_size=batch, **user, **recipe)
        resolved.spec = spec  # str(spec) parses back to spec: the copy takes this parse, not a second one
        return resolved

    def check_recipe(self, user: dict) -> dict:
        """The optimiser's flags checked, and those left out filled in (loop/optim.resolve)."""
        if self.optimizer and self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.optimizer == "muon" and muon.MISSING:
            raise ConfigError(muon.MISSING)
        if self.lr_schedule not in SCHEDULES:
            raise ConfigError(f"--lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        workload = usermodel.workload_of(dataclasses.replace(self, **user))  # token ids in: a transformer's
        transformer = workload.data == "tokens" or bool(self.vocab)  # a .pt of token ids: --vocab names it
        name, lr, wd, clip = resolve(self.optimizer, self.lr, self.weight_decay, self.clip_norm, transformer)
        if not (math.isfinite(lr) and lr > 0):
            raise ConfigError(f"--lr must be a positive finite number, got {lr}")
        if not (math.isfinite(wd) and wd >= 0):
            raise ConfigError(f"--weight-decay must be 0 or a positive number, got {wd}")
        if not (math.isfinite(clip) and clip >= 0):
            raise ConfigError(f"--clip-norm must be 0 (no clip) or a positive number, got {clip}")
        betas = self.betas.split(",")
        if len(betas) != 2 or not all(_number(b) and 0 <= float(b) < 1 for b in betas):
            raise ConfigError(f"--betas must be two numbers in [0, 1) as B1,B2 (0.9,0.95), got {self.betas!r}")
        if self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be 0 or more, got {self.warmup_steps}")
        return {"optimizer": name, "lr": lr, "weight_decay": wd, "clip_norm": clip}

    @property
    def shaped(self) -> bool:
        """The built-in transformer's shape is given (a preset or the planner's flags)."""
        return any(getattr(self, name) for name in ("preset", *SHAPE))

    @functools.cached_property
    def spec(self) -> DeviceSpec:
        """`devices` parsed, once per config: on the first read (validate's copy: given). Not a field, so
        results.json and to_json keep the text; a dataclasses.replace copy parses its own when first read."""
        return parse_devices(self.devices)

    def __setattr__(self, name: str, value) -> None:
        super().__setattr__(name, value)
        if name == "devices":  # another device list: the cached parse of the old one no longer holds
            self.__dict__.pop("spec", None)

    def check_divisible(self, parts: int, what: str) -> None:
        if self.batch_size % parts:
            raise ConfigError(f"global batch {self.batch_size} is not divisible by {what} {parts}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        data = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
