"""The strategy registry. Each strategy is one module with the same small surface:

    NAME = "ddp"                     # what the CLI and the report call it
    LAUNCH = "torchrun"              # "inprocess" | "torchrun" | "hogwild": how the harness starts it
    SYNCHRONOUS = True               # must match `single` within the equivalence tolerance
    def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable
    def train_step(trainable, batch, dist) -> loss tensor   # one optimiser step on this rank's share

and may override the defaults in base.py (world_size, check, device_kind, state_dict, ...) by declaring
them: `HOOKS = Hooks(check=check, ...)`; nothing else in the module is a hook. A strategy's own knobs
are an `Options` dataclass in its module: the CLI offers each field as a flag, and a comma list
(`--bucket-mb 1,4,25`) runs one variant per value, each a row of the report. The harness only ever talks
to `Strategy`; it never branches on a strategy's name.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import itertools
from types import ModuleType

from parallel import measure
from parallel.config import RunConfig
from parallel.loop import train
from parallel.models.workloads import Workload
from parallel.strategies import base
from parallel.world.errors import REPORT, CheckBroken, CheckFailed, ConfigError, last_line, raised_in

# The report lists strategies in this order; `single` is the baseline and always first.
BASELINE = "single"  # a role: one device, the reference every other strategy is checked against
NAMES = ["single", "manual_dp", "data_parallel", "manual_ddp", "ddp", "zero", "zero_optimizer", "fsdp", "manual_tp",
         "tensor_parallel", "fsdp_tp", "hogwild", "model_parallel", "pipeline", "pipeline_dist", "fsdp_pp",
         "context_parallel", "fsdp_cp", "torch_cp", "ulysses", "fsdp_ulysses", "expert_parallel"]
# Each strategy's folder: data parallelism splits the batch, model parallelism splits one batch's work, and
# composed runs two of them on a 2-D mesh. `single`, the reference, stands beside them.
FOLDERS = {"data": ("manual_dp", "data_parallel", "manual_ddp", "ddp", "hogwild", "zero_optimizer", "zero", "fsdp"),
           "model": ("manual_tp", "tensor_parallel", "model_parallel", "pipeline", "pipeline_dist",
                     "context_parallel", "torch_cp", "ulysses", "expert_parallel"),
           "composed": ("fsdp_tp", "fsdp_pp", "fsdp_cp", "fsdp_ulysses")}
MODULES = {"single": "parallel.strategies.single"} | {
    name: f"parallel.strategies.{folder}.{name}" for folder, names in FOLDERS.items() for name in names}


# The constants a strategy module may set, with their defaults. Its functions beyond setup and
# train_step are declared in `HOOKS = base.Hooks(...)` (see base.Hooks).
CONSTANTS = {"Options": None, "NOT_EXPECTED_REASON": None, "CHECKPOINTS": True, "MULTI_PART": False, "MUTANTS": (),
             "TENSOR_PARALLEL": False, "LAYERED": False,  # LAYERED: it cuts the model's pipeline_layers()
             "TIES": True,  # TIES: it trains a model whose weights are tied (one object in two places)
             "SEQUENCE": False,  # SEQUENCE: it splits the sequence, replacing the model's attention
             "EXPERTS": False,  # EXPERTS: it splits the model's routed experts (model.moe_layers())
             "ROUTING": False,  # ROUTING: its routers count over the whole batch (trains with --aux-loss)
             "SYNCS_BATCHNORM": False,  # SYNCS_BATCHNORM: its BatchNorm normalises by the whole batch's statistics
             "LOGITS_LOSS": False,  # LOGITS_LOSS: it takes cross-entropy over the logits it gathers (LAYERED: its
             #   last stage's), not the loss a model computes itself (parallel/models/outputs.py)
             "LAYER_ACTIVATIONS": False,  # one transformer layer's activations measured beside the formula
             "HALVES": None,  # the options under which one device runs its batch in two accumulated halves: a
             #   data-parallel reference for a model's own rounding noise (judge/noise.py)
             "SENDS_SEEN": True}  # False: what it moves between devices happens inside torch, unseen by the loop's
#                                   counter (nn.DataParallel's copies): the row shows no bytes


MEASURED = ("extra_measurements", "predict_step_ms", "comm_bytes_predicted")  # what a MEASURE family provides


def _hooks(module: ModuleType) -> base.Hooks:
    """The module's HOOKS; a function of the module's own that has a hook's name but is not declared
    there is an error (a hook that would silently never run)."""
    hooks = getattr(module, "HOOKS", base.Hooks())
    for f in dataclasses.fields(base.Hooks):
        own = module.__dict__.get(f.name)
        if callable(own) and getattr(own, "__module__", None) == module.__name__ and getattr(hooks, f.name) is not own:
            raise TypeError(f"{module.__name__}.{f.name} looks like a hook but is not in its HOOKS")
    return hooks


class Strategy:
    """A strategy module with every optional hook filled in by its default."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.name: str = module.NAME
        self.launch: str = module.LAUNCH
        self.synchronous: bool = module.SYNCHRONOUS
        first = (module.__doc__ or "").strip().splitlines()[0]
        self.description: str = first.removeprefix(f"{self.name}: ")
        for attr, default in CONSTANTS.items():
            setattr(self, attr, getattr(module, attr, default))
        hooks = _hooks(module)
        for f in dataclasses.fields(hooks):
            setattr(self, f.name, getattr(hooks, f.name))
        self.MEASURE = getattr(module, "MEASURE", None)  # its measurement family (parallel/measure/), lent callables
        for name in MEASURED:  # the family's measurement; none: the measurement of nothing (measure.Family)
            setattr(self, name, getattr(self.MEASURE or measure.Family(), name))
        for name in [f.name for f in dataclasses.fields(hooks)] + [*MEASURED]:  # each gets a Run, not the config
            setattr(self, name, self._handing(getattr(self, name)))
        self.train = self._handing(hooks.train) or train.train
        self.setup = self._handing(module.setup)
        self.train_step = module.train_step

    def run(self, config) -> base.Run:
        """What this strategy is handed in place of `config`: its typed options and the workload beside it."""
        return config if isinstance(config, base.Run) else base.Run(config, self.Options)

    def _handing(self, fn):
        """`fn` called with a Run wherever it was given a RunConfig."""
        if fn is None:
            return None

        @functools.wraps(fn)
        def handed(*args, **kwargs):
            return fn(*(self.run(a) if isinstance(a, RunConfig) else a for a in args), **kwargs)

        return handed

    def unsupported(self, workload: Workload) -> str | None:
        """Why this strategy cannot train `workload` (a Run's), or None."""
        if getattr(workload, "tokens", "even") == "packed" and (self.LAYERED or self.SEQUENCE):
            return ("packed sequences keep attention inside each document, from the tokens that start them, "
                    + ("which a stage after the first never sees" if self.LAYERED else
                       "and its attention masks by positions, not by document"))
        if workload.multi_part and not self.MULTI_PART:
            runs = ", ".join(n for n in NAMES if get(n).MULTI_PART)
            return f"its update has two models and two optimisers (strategies that run it: {runs})"
        if self.TENSOR_PARALLEL and not workload.tp_plan:
            return f"it has no tensor-parallel plan: {workload.no_tp_plan}"
        if self.LAYERED and not workload.layers:
            return f"it has no layers to cut into stages: {workload.no_layers}"
        if (self.LOGITS_LOSS or self.LAYERED) and workload.no_logits_loss:
            where = "its last stage's" if self.LAYERED else "the gathered"
            return f"{workload.no_logits_loss}, and this strategy takes cross-entropy over {where} logits"
        if self.SEQUENCE and not workload.splits_sequence:
            return ("it has no attention to split by the sequence: only the built-in transformer says where "
                    "its attention is (model.attentions())")
        if self.EXPERTS and not workload.experts:
            return (f"it has no routed experts to split: {workload.no_experts}" if workload.no_experts else
                    "it has no routed experts to split: a model says where they are with moe_layers() "
                    "(--workload moe; docs/experts.md)")
        if workload.aux_loss and not self.ROUTING:
            runs = ", ".join(n for n in NAMES if get(n).ROUTING)
            return (f"--aux-loss needs each router's counts summed over the whole batch, which this strategy does "
                    f"not do (strategies that do: {runs})")
        if workload.tied and not self.TIES:
            return (f"its {workload.tied} (tied) would have a copy in two stages, each sharded, whose gradients "
                    f"this strategy does not sum (pipeline and pipeline_dist do)")
        return None

    def kind(self, config) -> str:
        """What the row's devices are (its `device_kind`), and "serial" where a strategy other than `single`
        runs on one device: its machinery runs (hooks, replicas, collectives of one), nothing in parallel."""
        kind = self.device_kind(config.spec)
        if self.world_size(config) > 1 or kind == "pass-through":
            return kind
        if self.name == "single":  # one device of the list, alone: a GPU of a shared list is a real one
            return "real" if config.spec.real else "virtual"
        return "serial"

    def option_fields(self) -> list[dataclasses.Field]:
        return list(dataclasses.fields(self.Options)) if self.Options else []

    def options(self, config):
        """This strategy's own knobs, typed, from config.options (one value each); None if it has none."""
        if self.Options is None:
            return None
        for f in self.option_fields():
            if isinstance(config.options.get(f.name), list):
                raise ConfigError(f"{self.name}: --{f.name.replace('_', '-')} takes one value here, "
                                  f"got {config.options[f.name]}")
        return self.run(config).options  # its __post_init__ raises ConfigError for bad values

    def validate(self, config) -> str:
        """Every check of this strategy against a config (one variant's): its options, checkpointing,
        its own check(). ConfigError names what is wrong. -> why its check ran on a real copy of the model
        ("" where it did not: _checked)."""
        self.options(config)
        spec = config.spec
        if why := self.available(spec):  # here, not only in `compare`: scripts and `run` come through validate too
            raise ConfigError(f"{self.name} cannot run on {spec}: {why}")
        if why := self.unsupported(self.run(config).workload):
            raise ConfigError(f"{self.name} cannot train the {config.workload} workload: {why}")
        if config.mutant and config.mutant not in mutants():
            raise ConfigError(f"unknown mutant {config.mutant!r}; `python -m parallel mutants --list` lists them")
        if (config.checkpoint_every or config.resume or config.resume_from) and not self.CHECKPOINTS:
            raise ConfigError(f"{self.name} cannot checkpoint or resume (--checkpoint-every, --resume)")
        return self._checked(config)

    def _checked(self, config) -> str:
        """self.check, which may run a user's model on the meta device (its layers, the records a pipeline
        keeps): where the model's kernels refuse that device (grouped_mm in fp32, aten::equal), again on a
        real copy, and then the meta device's error is returned, for the report to say that the copy was
        used and why ("" where it was not). Where the copy fails too: CheckFailed, one line naming the model,
        the check and both errors, when the model's own code raised the second (errors.raised_in); else
        CheckBroken, the same line called a bug in the check (the user named it: exit 2)."""
        try:
            self.check(config)
            return ""
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - the user's model's own code, raised inside our check
            if not config.model:
                raise  # our own workloads: a bug of ours, shown as one
            first = e
        from parallel.models import usermodel

        try:
            with usermodel.built_for_real(config):
                self.check(config)
            return last_line(first)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001
            both = (f"{self.name}: its check of --model {config.model} failed on the meta device ({last_line(first)}) "
                    f"and on a real copy ({last_line(e)}")
            if where := raised_in(e, usermodel.their_files()):
                raise CheckFailed(f"{both}, raised by the model at {where})") from None
            raise CheckBroken(f"{both}, raised in parallel's check, not in the model: {REPORT})") from None

    def variants(self, config) -> list[tuple[str, object]]:
        """(label, config) for every combination of this strategy's list-valued options, e.g.
        ("bucket_mb=4", config with options {"bucket_mb": 4.0})."""
        own = {f.name: config.options[f.name] for f in self.option_fields() if f.name in config.options}
        lists = {k: (v if isinstance(v, list) else [v]) for k, v in own.items()}
        swept = [k for k, v in lists.items() if len(v) > 1]
        out = []
        for combo in itertools.product(*lists.values()):
            chosen = dict(zip(lists, combo, strict=True))
            label = ",".join(f"{k}={chosen[k]:g}" if isinstance(chosen[k], float) else f"{k}={chosen[k]}"
                             for k in swept)
            out.append((label, self.adapted(dataclasses.replace(config, options=chosen))))
        return out

    def adapted(self, config):
        """`config` with this strategy's own defaults fitted to it where the user gave no value (the
        pipelines' micro-batches to the stages and the batch: the `defaults` hook)."""
        fitted = {k: v for k, v in self.defaults(config).items() if k not in config.options}
        return dataclasses.replace(config, options={**config.options, **fitted}) if fitted else config

    def __repr__(self) -> str:
        return f"Strategy({self.name})"


def get(name: str) -> Strategy:
    if name not in NAMES:  # a near miss names the strategy meant (`dpp`: did you mean 'ddp'?)
        close = difflib.get_close_matches(name.lower(), NAMES, n=1)
        meant = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown strategy {name!r}{meant}; valid strategies: {', '.join(NAMES)}")
    return Strategy(importlib.import_module(MODULES[name]))


def all_strategies() -> list[Strategy]:
    return [get(n) for n in NAMES]


def halving() -> Strategy | None:
    """The first strategy that declares HALVES: how one device splits its batch into two accumulated halves,
    as data parallelism splits it (the noise measurement's reference on GPUs)."""
    return next((s for s in all_strategies() if s.HALVES is not None), None)


def mutants() -> dict[str, tuple[Strategy, base.Mutant]]:
    """Every strategy's injected bugs, by name: {"ddp:sum-not-mean": (ddp, its Mutant), ...}."""
    out = {}
    for s in all_strategies():
        for m in s.MUTANTS:
            if not m.name.startswith(f"{s.name}:"):
                raise TypeError(f"{s.module.__name__}: mutant {m.name!r} must be named {s.name}:<bug>")
            out[m.name] = (s, m)
    return out


def parse_list(text: str) -> list[str]:
    """`a,b` -> ["a", "b"], validated, duplicates dropped; `all` -> every strategy."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--strategies is empty; valid strategies: {', '.join(NAMES)}")
    for n in names:
        if n != "all":
            get(n)  # raises for an unknown name, listing the valid ones
    return list(dict.fromkeys(names))


def resolve(names: list[str], spec, workload: Workload, strict: bool = True) -> tuple[list[str], dict[str, str]]:
    """(strategies to run, {skipped: why}). `all` means every strategy that can run `workload` on `spec`;
    one named explicitly that cannot is an error, unless not `strict` (a scaling sweep's point with too few
    devices for it: skipped there, run at the others)."""
    run, skipped = [], {}
    for n in NAMES if "all" in names else names:
        s = get(n)
        device_why, workload_why = s.available(spec), s.unsupported(workload)
        if (device_why or workload_why) and "all" not in names and (strict or workload_why):
            raise ConfigError(f"{n} cannot run on {spec}: {device_why}" if device_why
                              else f"{n} cannot train the {workload.name} workload: {workload_why}")
        if device_why or workload_why:
            skipped[n] = device_why or workload_why
        else:
            run.append(n)
    return run, skipped
