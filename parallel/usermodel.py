"""Your own model through the same comparison: `--model FILE.py:FACTORY` (or `package.module:FACTORY`).

    python -m parallel compare --model examples/resnet.py:resnet18 --input-shape 3,32,32 --classes 10
    python -m parallel compare --model my_model.py:build --data batches.pt

The protocol. FACTORY(seed), or FACTORY() if it takes no argument, is called with torch already seeded
from the seed, so that every strategy, in every process, starts from bitwise the same weights (checked:
two calls must give the same weights); a factory with a `vocab` or `seq_len` parameter (or **kwargs) gets
the run's --vocab and --seq-len there too, so one factory serves every size. It returns

    an nn.Module                                trained with cross-entropy on (output, target), or on
                                                its own loss where forward takes `targets` or `labels`
                                                and returns one (parallel/outputs.py), or
    {"model": module,                           the same, and any of
     "loss": fn(output, target) -> scalar,      the loss instead of cross-entropy
     "layers": [modules forward runs in order], the pipeline's cut points (model_parallel, pipeline, ...)
     "tp_plan": TPPlan(colwise, rowwise)}       the tensor-parallel plan (manual_tp, tensor_parallel, ...)

A model may instead define pipeline_layers() and tp_plan() methods, as the built-in models do. A factory
with a `layers` or `n_layer` parameter (or a Hugging Face model, by its config's num_hidden_layers) has a
shallow twin: the same model with fewer blocks, what a model too big for one device is judged on
(harness/twin.py).

The data: `--input-shape C,H,W --classes K` (the built-in synthetic teacher: each sample a noisy copy
of one of K prototypes, labelled by the nearest), `--vocab V --seq-len T` (token sequences from a fixed
random Markov chain, next-token targets), or `--data FILE`: a .pt (loaded with weights_only=True) or .npz
holding `x` and `y` (inputs and targets, one row per sample). Of a file, the last eighth (at most 2048
samples) is held out for the eval loss and never trained on; every strategy takes the same batches from
the rest, by the same rule as the built-in data.

Structure, found where it is safe and never guessed:
    pipeline layers  "layers", or pipeline_layers(), or a Hugging Face decoder's embeddings, blocks (with
                     the extra inputs its forward gives them, parallel/hf.py), final norm and head, or an
                     nn.Sequential's children, or a model whose children (a ModuleList's expanded) run one
                     after another; run in order on a sample, they must give the model's own output
                     (checked), or the pipelines skip it and say why
    tensor parallel  only from "tp_plan" or tp_plan()
    FSDP2 groups     fsdp's rule, the parameter-holding elements of the model's containers (a ResNet's
                     blocks, a GPT's layers); the row's details list them

Every way this can go wrong is a ConfigError naming it, before anything starts: in the parent, once a
run. Its children (every strategy's processes) get the parent's findings in their environment
(`checked_env`) and build the model once, with no second build and no forward on a sample (at a real
size each cost seconds and gigabytes in every process).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parallel import hf, outputs
from parallel.data import SyntheticData
from parallel.errors import ConfigError
from parallel.moe import MoE
from parallel.outputs import first_line as _first_line
from parallel.transformer import SHAPE, shaped
from parallel.workloads import WORKLOADS, TPPlan, Workload, logits_of, tp_plan_of

HELD_OUT = 8  # a data file's last 1/HELD_OUT (at most 2048 samples) is the held-out set
PROTOCOL = ("model", "loss", "layers", "tp_plan")


def workload_of(config) -> Workload:
    """The workload a config names: one of the built-in ones, or the user's model (config.model)."""
    twin = getattr(config, "twin_blocks", 0)  # the shallow twin (harness/twin.py), where the run trains it
    if not config.model:
        built_in = WORKLOADS[config.workload]
        shape = {name: getattr(config, name, 0) for name in ("vocab", "preset", *SHAPE)}
        if any(shape.values()):  # the planner's flags: the transformer at that shape
            built_in = shaped(built_in, seq_len=config.seq_len, **shape)
        elif config.seq_len:
            built_in = built_in.with_seq_len(config.seq_len)
        built_in = built_in.with_aux_loss(config.aux_loss) if getattr(config, "aux_loss", 0) else built_in
        return built_in.shallow_twin(twin) if twin else built_in
    return _user(config.model, config.input_shape, config.classes, config.vocab, config.seq_len, config.data, twin)


def shape_model(config) -> nn.Module:
    """The run's model on the meta device: its layers, shapes and parameter counts at any size, with no
    memory and no initialisation, for the checks that only look (a strategy's check(), a prediction).
    A factory that cannot build there (it copies real tensors in) is built for real."""
    workload = workload_of(config)
    try:
        with torch.device("meta"):
            return workload.build_model(config.seed)
    except (RuntimeError, NotImplementedError, TypeError, ValueError):
        return workload.build_model(config.seed)


def resolve_spec(spec: str) -> str:
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
def _import(spec: str):
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
    except Exception as e:  # noqa: BLE001 - the user's module: its first line, not our traceback
        raise ConfigError(f"--model {spec}: importing it raised {_first_line(e)}") from None
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec}: {where} has no function {factory_name!r}")
    return factory


def _call(factory, seed: int, spec: str, sizes: tuple[tuple[str, int], ...] = ()) -> dict:
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
            raise ConfigError(f"--model {spec}: the factory raised {_first_line(e)}") from None
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
        raise ConfigError(f"--model {spec}: 'tp_plan' must be a parallel.workloads.TPPlan")
    return out


DEPTH_ARGS = ("layers", "n_layer")  # a factory's argument for its number of blocks: the shallow twin's knob


def depth_arg(factory) -> str:
    """The argument of `factory` that sets its number of blocks (DEPTH_ARGS), or ""."""
    params = inspect.signature(factory).parameters
    return next((n for n in DEPTH_ARGS if n in params and params[n].kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                              inspect.Parameter.KEYWORD_ONLY)), "")


def _made(factory, seed: int, spec: str, sizes: tuple, hf_blocks: int = 0) -> dict:
    """_call; with `hf_blocks`, the Hugging Face model the factory returns rebuilt by its own class from
    its config with that many blocks (num_hidden_layers), seeded alike: the shallow twin of a factory
    that has no depth argument. The full model is only built on the meta device, where it can be."""
    if not hf_blocks:
        return _call(factory, seed, spec, sizes)
    try:
        with torch.device("meta"):
            out = _call(factory, seed, spec, sizes)
    except ConfigError:  # it cannot be built there (it copies real tensors in): built for real
        out = _call(factory, seed, spec, sizes)
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


def _shape(text: str, what: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r}: expected sizes like 3,32,32") from None
    if not shape or min(shape) < 1:
        raise ConfigError(f"{what} {text!r}: expected sizes like 3,32,32, each at least 1")
    return shape


def _load_data(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    p = Path(path)  # it exists: RunConfig.validate checked, with the path as given
    try:
        if p.suffix == ".npz":
            import numpy as np

            with np.load(p, allow_pickle=False) as f:
                x, y = torch.from_numpy(f["x"]), torch.from_numpy(f["y"])
        elif p.suffix == ".pt":
            obj = torch.load(p, weights_only=True, map_location="cpu")
            x, y = (obj["x"], obj["y"]) if isinstance(obj, dict) else obj
        else:
            raise ConfigError(f"--data {path}: expected a .pt or .npz file")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file, missing keys, or something not two tensors
        raise ConfigError(f"--data {path}: cannot read x and y from it ({_first_line(e)})") from None
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)) or x.shape[:1] != y.shape[:1] or not len(x):
        raise ConfigError(f"--data {path}: x and y must be tensors with one row per sample, the same number of rows")
    if len(x) < 2 * HELD_OUT:
        raise ConfigError(f"--data {path}: {len(x)} samples; at least {2 * HELD_OUT} are needed (1/{HELD_OUT} is "
                          "held out)")
    x = x.float() if x.is_floating_point() else x.long()  # numpy's float64 -> the models' float32
    y = y.float() if y.is_floating_point() else y.long()
    return x.contiguous(), y.contiguous()


class FileData(SyntheticData):
    """SyntheticData's interface over the user's tensors: training batches from the first part, the
    held-out set from the last eighth."""

    def __init__(self, workload: UserWorkload, seed: int, batch_size: int):
        x, y = _file(workload.data_file)
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        keep = training_samples(len(x))
        self.x, self.y, self._held = x[:keep], y[:keep], (x[keep:], y[keep:])

    def heldout(self, n: int = 2048):
        return self._held


def training_samples(n: int) -> int:
    """Of a file's n samples, those trained on: all but the held-out last eighth (at most 2048)."""
    return n - min(2048, n // HELD_OUT)


def check_batch(data: str, batch_size: int) -> None:
    """A global batch must fit in the file's training samples (batches would repeat samples otherwise)."""
    if batch_size > (n := training_samples(len(_file(data)[0]))):
        raise ConfigError(f"--batch-size {batch_size} is more than the {n} samples of --data {data} that are "
                          f"trained on (the last 1/{HELD_OUT} is held out)")


@functools.lru_cache(maxsize=2)
def _file(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _load_data(path)


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
    hf_seq_len: int = 0  # > 0: the layers are a Hugging Face decoder's, made by parallel.hf for this length
    has_experts: bool = False  # its routed layers are parallel.moe.MoE (declared by moe_layers(), or found)
    aux_weight: float = 0.0  # their load-balancing loss's weight (MoE.aux_weight), the largest
    targets: str = ""  # the name its forward takes the targets by, returning its own loss (parallel/outputs.py)
    hf_blocks: int = 0  # > 0: the shallow twin of a Hugging Face model, rebuilt with this many blocks (_made)

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
        out = _made(self.factory, seed, self.spec, self.sizes, self.hf_blocks)
        model = out["model"]
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
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

    def dataset(self, seed: int, batch_size: int) -> SyntheticData:
        return FileData(self, seed, batch_size) if self.data_file else SyntheticData(self, seed, batch_size)


def _submodules(model: nn.Module, names: tuple[str, ...]) -> list[nn.Module]:
    return [model.get_submodule(n) for n in names]


def _hf_layers(model: nn.Module, seq_len: int) -> list[nn.Module]:
    return hf.decoder_layers(model, seq_len)[0]  # validate made them once on a model built alike


def _in_order(model: nn.Module, given, sample: torch.Tensor, targets) -> tuple[tuple[str, ...] | None, str, bool]:
    """(the names of the layers the pipelines cut at, "", from_hf) or (None, why not, False): the factory's
    'layers', the model's pipeline_layers(), a Hugging Face decoder's (parallel.hf), or its children; each
    run one after another on a sample must give the model's own output (an nn.Sequential's always do)."""
    names = {id(m): n for n, m in model.named_modules()}
    from_hf = False
    if given is not None:
        if not given or not all(isinstance(m, nn.Module) and id(m) in names for m in given):
            return None, "its 'layers' must be modules of the model", False
        layers, what = list(given), "its 'layers'"
    elif hasattr(model, "pipeline_layers"):
        layers, what = model.pipeline_layers(), "its pipeline_layers()"
    elif hf.is_decoder(model) and sample.dim() == 2 and not sample.is_floating_point():
        try:
            layers, why = hf.decoder_layers(model, sample.shape[1])
        except Exception as e:  # noqa: BLE001 - transformers' internals, a shape the recording did not expect
            layers, why = [], _first_line(e)
        if not layers:
            return None, f"its blocks cannot be cut apart: {why}; return 'layers' from the factory", False
        what, from_hf = "its embeddings, blocks, final norm and head", True
    else:
        found = []
        for name, child in model.named_children():
            found += [f"{name}.{n}" for n, _ in child.named_children()] if isinstance(child, nn.ModuleList) else [name]
        if len(found) < 2:
            return None, "it has fewer than two children to cut between; return 'layers' from the factory", False
        if isinstance(model, nn.Sequential):
            return tuple(found), "", False
        layers, what = [model.get_submodule(n) for n in found], "its children"
    if why := _differs(model, layers, sample, targets, what):
        return None, why, False
    return tuple(_layer_name(m, names) for m in layers), "", from_hf


def _layer_name(layer: nn.Module, names: dict[int, str]) -> str:
    return names.get(id(layer)) or "+".join(getattr(layer, "owners", {}).values()) or type(layer).__name__


def _differs(model: nn.Module, layers: list[nn.Module], sample: torch.Tensor, targets, what: str) -> str:
    """Why `layers` run one after another are not `model` on `sample` ("" when they are); a model that takes
    its `targets` is given them (outputs.call), so that its logits are every position's. The same operations
    in the same order give the same numbers; 1e-5 of the output's scale allows for a kernel that takes
    another path on a differently shaped call."""
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            h = sample
            for layer in layers:
                h = layer(h)
            want = logits_of(outputs.call(model, sample, targets))
    except Exception as e:  # noqa: BLE001 - a layer that does not take the previous one's output
        return (f"its forward() is not {what} run one after another: they fail on a sample ({_first_line(e)}); "
                "return 'layers' from the factory")
    finally:
        model.train()
    if not isinstance(h, torch.Tensor) or not isinstance(want, torch.Tensor) or h.shape != want.shape:
        return (f"its forward() is not {what} run one after another: they give {tuple(getattr(h, 'shape', ()))}, "
                f"it {tuple(getattr(want, 'shape', ()))} (checked on a sample)")
    gap = float((h.float() - want.float()).abs().max()) if h.numel() else 0.0
    if gap > 1e-5 * max(1.0, float(want.float().abs().max())):
        return (f"its forward() is not {what} run one after another (checked on a sample: they differ by up to "
                f"{gap:.3g}): a module left out or out of order? give every module forward runs, in order")
    return ""


@functools.lru_cache(maxsize=8)
def _user(spec: str, input_shape: str, classes: int, vocab: int, seq_len: int, data: str,
          twin: int = 0) -> UserWorkload:
    """The user's model and data, checked; `twin` > 0: its shallow twin of that many blocks (its depth
    argument, else a Hugging Face config's num_hidden_layers), checked alike."""
    factory, sizes = _import(spec), (("vocab", vocab), ("seq_len", seq_len))
    knob = depth_arg(factory) if twin else ""
    sizes, hf_blocks = (*sizes, (knob, twin)) if knob else sizes, 0 if knob else twin
    found = _found_by_parent(spec, sizes, hf_blocks)
    out = _made(factory, 0, spec, sizes, hf_blocks)
    model = out["model"]
    if found is None:
        a, b = model.state_dict(), _made(factory, 0, spec, sizes, hf_blocks)["model"].state_dict()
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            raise ConfigError(f"--model {spec}: two calls with the same seed gave different weights; draw them "
                              "from torch's generator (seeded by the harness) or from the seed it is given")
    label = spec.rpartition(":")[0]
    label = f"{Path(label).name}:{spec.rpartition(':')[2]}" if label.endswith(".py") else spec
    if sum(bool(v) for v in (data, input_shape or classes, vocab or seq_len)) != 1:
        raise ConfigError(f"--model {label} needs its data: --input-shape and --classes, --vocab and --seq-len, "
                          "or --data FILE (one of them)")
    if data:
        x, y = _file(data)
        kind, shape, n_classes, source = "file", tuple(x.shape[1:]), 0, f"--data {data}"
        sample_x, sample_y = x[:4], y[:4]
    elif vocab or seq_len:
        if vocab < 2 or seq_len < 1:
            raise ConfigError("--vocab needs at least 2 tokens and --seq-len at least 1")
        kind, shape, n_classes, source = "tokens", (seq_len,), vocab, f"tokens of {vocab} x {seq_len}"
    else:
        if not input_shape or classes < 2:
            raise ConfigError("--input-shape and --classes go together (--classes at least 2)")
        shape = _shape(input_shape, "--input-shape")
        kind, n_classes, source = "teacher", classes, f"inputs {shape}, {classes} classes"
    params = sum(p.numel() for p in model.parameters())
    # Held samples (teacher): at most 64 MB of inputs, batches wrap around them; tokens: drawn per step.
    size = len(_file(data)[0]) if data else max(1024, min(8192, 2**24 // math.prod(shape)))
    if isinstance(getattr(type(model), "tp_plan", None), property):  # transformers': read by tp_plan_of
        no_plan = f"transformers' own plan for {type(model).__name__} splits no nn.Linear layer, and the factory " \
                  "returned no 'tp_plan'"
    else:
        no_plan = "the factory returned no 'tp_plan', and the model defines no tp_plan()"
    twin_of = f"; its shallow twin, {twin} block{'s' if twin > 1 else ''}" if twin else ""
    base = dict(name=label, description=f"{type(model).__name__} from {label}, {params / 1e6:.2f}M params{twin_of}",
                make_module=factory, input_shape=shape, classes=n_classes or 10, data=kind, dataset_size=size,
                no_tp_plan=no_plan)
    workload = UserWorkload(**base, spec=spec, factory=factory, sizes=sizes, loss_fn=out.get("loss"), data_file=data,
                            has_plan=out.get("tp_plan") is not None or tp_plan_of(model) is not None,
                            parts_model=hasattr(model, "parts"), causes=tuple(cannot_match(model).values()),
                            tied=tied_names(model), hf_blocks=hf_blocks)
    if found is None:  # the checks that run the model on a sample: in the parent only
        if not data:
            sample_x, sample_y = SyntheticData(workload, 0, 4).batch(0)
        targets, no_logits_loss = outputs.check(label, model, out.get("loss"), sample_x, sample_y, source)
        setattr(model, outputs.KEYWORD, targets)  # so that the layers' check below gets every position's logits
        names, why, from_hf = _in_order(model, out.get("layers"), sample_x, sample_y)
        found = {"layer_names": names, "no_layers": why, "hf_seq_len": sample_x.shape[1] if from_hf else 0,
                 "targets": targets, "no_logits_loss": no_logits_loss}
    has_experts, no_experts = experts_of(model)
    return dataclasses.replace(workload, **found, has_experts=has_experts, no_experts=no_experts,
                               aux_weight=max((m.aux_weight for m in moe_layers_of(model) if isinstance(m, MoE)),
                                              default=0.0))


FOUND = "PARALLEL_MODEL_FOUND"  # the parent's findings on a user's model, for its run's children (JSON)
_FINDINGS = ("layer_names", "no_layers", "hf_seq_len", "targets", "no_logits_loss")


def checked_env(workload: Workload) -> dict[str, str]:
    """The environment a run's child gets: what the parent's checks found in the user's model (none for a
    built-in one), so that the child neither builds it twice nor runs it on a sample again."""
    if not isinstance(workload, UserWorkload):
        return {}
    key = [workload.spec, workload.sizes, workload.hf_blocks]  # the model as built (a twin is another)
    return {FOUND: json.dumps({"key": key, **{k: getattr(workload, k) for k in _FINDINGS}})}


def _found_by_parent(spec: str, sizes: tuple, hf_blocks: int) -> dict | None:
    """The parent's findings (checked_env) on this model, in a child of its run; None elsewhere."""
    found = json.loads(os.environ.get(FOUND) or "{}")
    if found.pop("key", None) != json.loads(json.dumps([spec, sizes, hf_blocks])):
        return None
    names = found["layer_names"]
    return found | {"layer_names": tuple(names) if names is not None else None}


def moe_layers_of(model: nn.Module) -> list[MoE]:
    """The model's routed layers: its moe_layers(), else every parallel.moe.MoE it holds, in order."""
    return list(model.moe_layers()) if hasattr(type(model), "moe_layers") else \
        [m for m in model.modules() if isinstance(m, MoE)]


def experts_of(model: nn.Module) -> tuple[bool, str]:
    """(expert parallelism can split it, why not): its routed layers must be parallel.moe.MoE (whose
    `dispatch` expert_parallel replaces) with one expert count."""
    layers = moe_layers_of(model)
    if layers and all(isinstance(m, MoE) for m in layers):
        if len({m.num_experts for m in layers}) > 1:
            return False, "its MoE layers have different expert counts"
        return True, ""
    other = sorted({type(m).__name__ for m in model.modules() if re.search(r"moe|expert", type(m).__name__, re.I)})
    if other or hasattr(type(model), "moe_layers"):
        found = f" ({', '.join(other[:3])})" if other else ""
        return False, (f"its experts{found} are not parallel.moe.MoE layers, whose dispatch expert_parallel "
                       "replaces (docs/experts.md)")
    return False, "it has no parallel.moe.MoE layers (docs/experts.md)"


def tied_names(model: nn.Module) -> str:
    """The model's tied weights as "lm_head.weight = transformer.wte.weight" ("" for none)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return ", ".join(" = ".join(reversed(group)) for group in names.values() if len(group) > 1)


def cannot_match(model: nn.Module) -> dict[str, str]:
    """What in the model makes a strategy's training differ from one device's even when the strategy is
    right, by cause: "dropout" (modules with p > 0, or a Hugging Face config's dropout rates, which its
    attention applies functionally): every run draws other random masks; "batchnorm": each device
    normalises its share of the batch by its own statistics (ddp synchronises them). Found before the
    run, said at its start and named in the verdict of a row that mismatches."""
    out = {}
    drops = [m.p for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0]
    # transformers' attention applies its dropout functionally (no module to find): Llama, Qwen2, Mixtral ...
    rate = getattr(getattr(model, "config", None), "attention_dropout", 0.0)
    rate = rate if isinstance(rate, float) and rate > 0 else 0.0
    if drops or rate:
        where = ", ".join(([f"{len(drops)} dropout module(s), p up to {max(drops):g}"] if drops else [])
                          + ([f"config attention_dropout = {rate:g}"] if rate else []))
        out["dropout"] = (f"dropout is on ({where}): every run draws other random masks, so no strategy can "
                          "match one device; set dropout to 0 to compare")
    if norms := [n for n, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]:
        out["batchnorm"] = (f"BatchNorm ({len(norms)} layer(s)) normalises each device's share of the batch by its "
                            "own statistics; ddp synchronises them (SyncBatchNorm), the other strategies do not")
    return out


def describe(workload: Workload) -> str:
    """One line on what the harness found in a user's model; for the built-in transformer given a shape,
    that shape (empty for the other built-in ones)."""
    if not isinstance(workload, UserWorkload):
        return workload.description if "arch" in dict(workload.model_args) else ""
    layers = (f"pipeline layers {', '.join(workload.layer_names)}" if workload.layer_names
              else f"no pipeline layers: {workload.no_layers}")
    experts = "; experts: parallel.moe.MoE layers" if workload.has_experts else ""
    own = f"; trained on its own loss (forward's {workload.targets!r})" if workload.targets else ""
    plan = "yes" if workload.has_plan else "no"
    return "\n".join([f"{workload.description}{own}; {layers}; tensor-parallel plan: {plan}{experts}",
                      *(f"note: {text}" for text in workload.causes)])  # notes: again in a mismatch


def add_arguments(p) -> None:
    """--model and its data's flags, for every command that trains (compare, run, preflight, the scripts)."""
    g = p.add_argument_group("your own model (parallel/usermodel.py, examples/)")
    g.add_argument("--model", default="", help="FILE.py:FACTORY or package.module:FACTORY, a function of the seed "
                                               "returning an nn.Module (or a dict: model, loss, layers, tp_plan)")
    g.add_argument("--input-shape", default="", help="one sample's shape for synthetic data, e.g. 3,32,32")
    g.add_argument("--classes", type=int, default=0, help="classes of the synthetic data (with --input-shape)")
    g.add_argument("--vocab", type=int, default=0, help="tokens of synthetic sequences (with --seq-len)")
    g.add_argument("--seq-len", "--seq", type=int, default=0, help="length of synthetic token sequences (with "
                   "--vocab); alone, the built-in transformer's (context parallelism); --seq is plan's spelling")
    g.add_argument("--data", default="", help=".pt or .npz file with x and y, one row per sample")


def argv(config) -> list[str]:
    """The flags that name the config's model and data again, for a command started from it."""
    if not config.model:
        shape = {"--vocab": config.vocab, "--seq-len": config.seq_len, **{
            f"--{name.replace('_', '-')}": getattr(config, name) for name in SHAPE if name != "tied"}}
        return ["--workload", config.workload, *(x for k, v in shape.items() if v for x in (k, str(v))),
                *(["--tied"] if config.tied else [])]
    flags = {"--model": config.model, "--input-shape": config.input_shape, "--classes": config.classes,
             "--vocab": config.vocab, "--seq-len": config.seq_len, "--data": config.data}
    return [x for k, v in flags.items() if v for x in (k, str(v))]
