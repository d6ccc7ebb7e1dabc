"""Loading a user's model (`--model FILE.py:FACTORY` or `package.module:FACTORY`): the factory imported,
called by the protocol (usermodel.py's docstring) and its answer checked, and UserWorkload, the Workload
that builds it again in every process, the same seed giving the same weights.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
import inspect
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models import hf, outputs
from parallel.models.data import IGNORE, SyntheticData
from parallel.models.tokenfile import TokenFile, is_token_file
from parallel.models.userchecks import moe_layers_of
from parallel.models.userdata import FileData
from parallel.models.workloads import TPPlan, Workload, logits_of
from parallel.world.errors import ConfigError, theirs_line

PROTOCOL = ("model", "loss", "layers", "tp_plan")
BUILT: set[str] = set()  # the source files of the user's models this process built


def resolve_factory(spec: str) -> str:
    """`path.py:factory` with the path made absolute (children may start elsewhere), or `module:factory`."""
    where, sep, factory = spec.rpartition(":")
    if not sep or not where or not factory.isidentifier():
        raise ConfigError(f"--model {spec!r}: expected FILE.py:FACTORY or package.module:FACTORY")
    if where.endswith(".py") or "/" in where:
        path = Path(where).expanduser()
        if not path.is_file():
            raise ConfigError(f"--model {spec}: no such file {where}")
        return f"{path.resolve()}:{factory}"
    return spec


@functools.lru_cache(maxsize=8)
def load_factory(spec: str):
    """The factory a resolved spec names (resolve_factory), imported once per process."""
    where, _, factory_name = spec.rpartition(":")
    try:
        if where.endswith(".py") or "/" in where:
            # Imported under its own name, its folder at the end of sys.path, so that a spawned process
            # (Hogwild's workers unpickle the model) can import it again; a name already taken gets a prefix.
            path = Path(where)
            if str(path.parent) not in sys.path:
                sys.path.append(str(path.parent))
            found = importlib.util.find_spec(path.stem) if path.stem.isidentifier() else None
            plain = path.stem not in sys.modules and found is not None and found.origin == str(path)
            name = path.stem if plain else f"user_{zlib.crc32(str(path).encode()):08x}_{path.stem}"
            loader = importlib.util.spec_from_file_location(name, where)
            module = importlib.util.module_from_spec(loader)
            sys.modules[name] = module  # dataclasses and pickling look a module up by name
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as e:  # noqa: BLE001 - the user's module: its first line and where, not our traceback
        raise ConfigError(f"--model {spec}: importing it raised {theirs_line(e)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec}: {where} has no function {factory_name!r}")
    return factory


def call_factory(factory, seed: int, spec: str, sizes: tuple[tuple[str, int], ...] = ()) -> dict:
    """The factory's result as the protocol's dict, checked. `sizes`: the run's (name, size) pairs
    (vocab, seq_len), given as keywords to a factory that takes them; its first other parameter: the seed."""
    params, named = inspect.signature(factory).parameters.values(), dict(sizes)
    takes_seed = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) and p.name not in named
                     for p in params)
    takes = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    every = any(p.kind == p.VAR_KEYWORD for p in params)
    given = {k: v for k, v in named.items() if v and (every or k in takes)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            out = factory(seed, **given) if takes_seed else factory(**given)
        except Exception as e:  # noqa: BLE001
            raise ConfigError(f"--model {spec}: the factory raised {theirs_line(e)}") from None
    if isinstance(out, nn.Module):
        out = {"model": out}
    if not isinstance(out, dict) or not isinstance(out.get("model"), nn.Module):
        got = type(out.get("model") if isinstance(out, dict) else out).__name__
        raise ConfigError(f"--model {spec}: the factory returned {got}, not an nn.Module (or a dict with "
                          f"'model': an nn.Module)")
    if unknown := sorted(set(out) - set(PROTOCOL)):
        raise ConfigError(f"--model {spec}: the factory returned unknown key {unknown[0]!r} (known: "
                          f"{', '.join(PROTOCOL)})")
    if out.get("loss") is not None and not callable(out["loss"]):
        raise ConfigError(f"--model {spec}: 'loss' must be a function (output, target) -> scalar")
    if (plan := out.get("tp_plan")) is not None and not isinstance(plan, TPPlan):
        raise ConfigError(f"--model {spec}: 'tp_plan' must be a parallel.models.workloads.TPPlan")
    return out


DEPTH_ARGS = ("layers", "n_layer")  # a factory's argument for its number of blocks: the shallow twin's knob


def depth_arg(factory) -> str:
    """The argument of `factory` that sets its number of blocks (DEPTH_ARGS), or ""."""
    params = inspect.signature(factory).parameters
    return next((n for n in DEPTH_ARGS if n in params and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                              inspect.Parameter.KEYWORD_ONLY)), "")


def made(factory, seed: int, spec: str, sizes: tuple, hf_blocks: int = 0) -> dict:
    """call_factory; with `hf_blocks`, the Hugging Face model the factory returns rebuilt by its own class from
    its config with that many blocks (num_hidden_layers), seeded alike: the shallow twin of a factory
    that has no depth argument. The full model is only built on the meta device, where it can be."""
    if not hf_blocks:
        return call_factory(factory, seed, spec, sizes)
    try:
        with torch.device("meta"):
            out = call_factory(factory, seed, spec, sizes)
    except ConfigError:  # it cannot be built there (it copies real tensors in): built for real
        out = call_factory(factory, seed, spec, sizes)
    model = out["model"]
    if not hasattr(getattr(model, "config", None), "num_hidden_layers") or {"layers", "tp_plan"} & out.keys():
        what = "it returns 'layers' or a 'tp_plan' of the whole model" if hasattr(model, "config") else \
            "its model is not a Hugging Face one with num_hidden_layers in its config"
        raise ConfigError(f"--model {spec}: its factory takes no {' or '.join(DEPTH_ARGS)} argument for its number "
                          f"of blocks, and {what}")
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = hf_blocks
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return {**out, "model": type(model)(config)}


@dataclass(frozen=True, eq=False)
class UserWorkload(Workload):
    """A Workload around the user's factory: same seed, same weights; the protocol's extras attached."""

    spec: str = ""
    factory: object = None
    sizes: tuple[tuple[str, int], ...] = ()  # the run's sizes a factory may take: (("vocab", V), ("seq_len", T))
    loss_fn: object = None
    layer_names: tuple[str, ...] | None = None  # where the pipelines cut, by module name; None: they cannot
    has_plan: bool = False
    parts_model: bool = False
    data_file: str = ""
    causes: tuple[str, ...] = ()  # cannot_match's texts, found once on the model validate built
    hf_seq_len: int = 0  # > 0: the layers are a Hugging Face decoder's, made by parallel.models.hf for this length
    has_experts: bool = False  # its routed layers are parallel.models.moe.MoE (declared by moe_layers(), or found)
    aux_weight: float = 0.0  # their load-balancing loss's weight (MoE.aux_weight), the largest
    targets: str = ""  # the name its forward takes the targets by, returning its own loss (parallel/models/outputs.py)
    sums: bool = False  # its own loss comes as a sum over the real targets and their count (outputs.sum_in)
    hf_blocks: int = 0  # > 0: the shallow twin of a Hugging Face model, rebuilt with this many blocks (made)

    def _key(self) -> tuple:  # the model as built and the data it trains on: two --data files are two workloads
        return self.spec, self.sizes, self.hf_blocks, self.data_file, self.tokens, self.input_shape, self.classes, \
            self.data

    def __eq__(self, other) -> bool:  # Workload's own would compare its fields alone (caches keyed by it: _heldout)
        return type(other) is type(self) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    @property
    def multi_part(self) -> bool:
        return self.parts_model

    @property
    def tp_plan(self) -> bool:
        return self.has_plan

    @property
    def layers(self) -> bool:
        return self.layer_names is not None

    @property
    def experts(self) -> bool:
        return self.has_experts

    @property
    def aux_loss(self) -> float:
        return self.aux_weight

    def build_model(self, seed: int) -> nn.Module:
        out = made(self.factory, seed, self.spec, self.sizes, self.hf_blocks)
        model = out["model"]
        BUILT.update(outputs.model_files(model))  # where an error it raises is the user's (usermodel.their_files)
        # Attached to the instance as partials of module-level functions: Hogwild pickles the model.
        if out.get("tp_plan") is not None:  # read by workloads.tp_plan_of, a name no library uses
            model._parallel_tp_plan = out["tp_plan"]
        if self.hf_seq_len:
            model.pipeline_layers = functools.partial(_hf_layers, model, self.hf_seq_len)
        elif self.layer_names is not None and not hasattr(type(model), "pipeline_layers"):
            model.pipeline_layers = functools.partial(_submodules, model, self.layer_names)
        if self.has_experts and not hasattr(type(model), "moe_layers"):
            model.moe_layers = functools.partial(moe_layers_of, model)
        if self.targets:  # outputs.call gives it the targets wherever the whole model runs
            setattr(model, outputs.KEYWORD, self.targets)
        return model

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is not None:  # the user's loss gets the output as the model returned it
            return self.loss_fn(output, target)
        if self.targets and (own := outputs.loss_in(output)) is not None:  # called with its targets: its own
            return own.reshape(())
        output = logits_of(output)  # a Hugging Face ModelOutput's (a pipeline's last stage: the tensor itself)
        return F.cross_entropy(output.flatten(0, -2), target.flatten(), ignore_index=IGNORE)

    def dataset(self, seed: int, batch_size: int) -> SyntheticData:
        if not self.data_file:
            return SyntheticData(self, seed, batch_size)
        return (TokenFile if is_token_file(self.data_file) else FileData)(self, seed, batch_size)


def _submodules(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [model.get_submodule(n) for n in names]


def _hf_layers(model: nn.Module, seq_len: int) -> list[nn.Module]:
    return hf.decoder_layers(model, seq_len)[0]  # validate made them once on a model built alike
