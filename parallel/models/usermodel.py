"""Your own model through the same comparison: `--model FILE.py:FACTORY` (or `package.module:FACTORY`).

    python -m parallel compare --model examples/resnet.py:resnet18 --input-shape 3,32,32 --classes 10
    python -m parallel compare --model my_model.py:build --data batches.pt

The protocol. FACTORY(seed), or FACTORY() if it takes no argument, is called with torch already seeded
from the seed, so that every strategy, in every process, starts from bitwise the same weights (checked:
two calls must give the same weights); a factory with a `vocab` or `seq_len` parameter (or **kwargs) gets
the run's --vocab and --seq-len there too, so one factory serves every size. It returns

    an nn.Module                                trained with cross-entropy on (output, target), or on
                                                its own loss where forward takes `targets` or `labels`
                                                and returns one (parallel/models/outputs.py), or
    {"model": module,                           the same, and any of
     "loss": fn(output, target) -> scalar,      the loss instead of cross-entropy
     "layers": [modules forward runs in order], the pipeline's cut points (model_parallel, pipeline, ...)
     "tp_plan": TPPlan(colwise, rowwise)}       the tensor-parallel plan (manual_tp, tensor_parallel, ...)

A model may instead define pipeline_layers() and tp_plan() methods, as the built-in models do. A factory
with a `layers` or `n_layer` parameter (or a Hugging Face model, by its config's num_hidden_layers) has a
shallow twin: the same model with fewer blocks, what a model too big for one device is judged on
(judge/twin.py).

The data: `--input-shape C,H,W --classes K` (the built-in synthetic teacher: each sample a noisy copy
of one of K prototypes, labelled by the nearest), `--vocab V --seq-len T` (token sequences from a fixed
random Markov chain, next-token targets), or `--data FILE`: a .pt (loaded with weights_only=True) or .npz
holding `x` and `y` (inputs and targets, one row per sample). Of a file, the last eighth (at most 2048
samples) is held out for the eval loss and never trained on; every strategy takes the same batches from
the rest, by the same rule as the built-in data.

Structure, found where it is safe and never guessed:
    pipeline layers  "layers", or pipeline_layers(), or a Hugging Face decoder's embeddings, blocks (with
                     the extra inputs its forward gives them, parallel/models/hf.py), final norm and head, or an
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

This module puts the parts together (workload_of): userload.py imports and calls the factory (its
UserWorkload builds the model in every process), userdata.py reads a data file, userchecks.py finds
the structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
from pathlib import Path

import torch
from torch import nn

from parallel.models import outputs, tokenfile, userchecks, userdata, userload
from parallel.models.data import FILE, IGNORE
from parallel.models.moe import MoE
from parallel.models.transformer import SHAPE, shaped
from parallel.models.userchecks import cannot_match, experts_of, moe_layers_of, tied_names
from parallel.models.userload import UserWorkload
from parallel.models.workloads import WORKLOADS, Workload, tp_plan_of, unhonoured_hf_plan
from parallel.world.errors import CheckFailed, ConfigError, theirs_line


def workload_of(config) -> Workload:
    """The workload a config names: one of the built-in ones, or the user's model (config.model)."""
    twin = getattr(config, "twin_blocks", 0)  # the shallow twin (judge/twin.py), where the run trains it
    tokens = getattr(config, "tokens", "even")  # uneven token batches (--tokens padded)
    if not config.model:
        built_in = WORKLOADS[config.workload]
        shape = {name: getattr(config, name, 0) for name in ("vocab", "preset", *SHAPE)}
        if any(shape.values()):  # the planner's flags: the transformer at that shape
            built_in = shaped(built_in, seq_len=config.seq_len, **shape)
        elif config.seq_len:
            built_in = built_in.with_seq_len(config.seq_len)
        built_in = built_in.with_aux_loss(config.aux_loss) if getattr(config, "aux_loss", 0) else built_in
        built_in = built_in.shallow_twin(twin) if twin else built_in
        return built_in.with_tokens(tokens) if tokens != "even" else built_in
    user = _user(config.model, config.input_shape, config.classes, config.vocab, config.seq_len, config.data, twin)
    if tokens != "even" and config.data:
        raise ConfigError(f"--tokens {tokens} makes the synthetic token data uneven; --data {config.data} brings its "
                          f"own targets ({IGNORE} where one does not count)")
    user = user.with_tokens(tokens) if tokens != "even" else user
    if user.tokens != "even" and user.targets:  # once a process for each model and seed
        _takes_padding(user, (config.model, config.vocab, config.seq_len, config.data, twin), config.seed)
    return user


_PADDING_CHECKED: set[tuple] = set()


def _takes_padding(workload: UserWorkload, model: tuple, seed: int) -> None:
    """A model that computes its own loss from the targets it is given must leave padding's targets out
    (IGNORE, -100: cross-entropy's default and Hugging Face's): a sample with one such target through it,
    or ConfigError."""
    if (model, seed) in _PADDING_CHECKED:
        return
    x, y = workload.dataset(seed, 2).batch(0)
    y = y.clone(memory_format=torch.contiguous_format)
    y.view(len(y), -1)[:, -1] = IGNORE  # whatever lengths were drawn, the sample holds padding's target
    try:
        with torch.no_grad():
            outputs.call(workload.build_model(seed).eval(), x, y)
    except (IndexError, RuntimeError, ValueError) as e:
        where = f"--data {workload.data_file}" if workload.tokens == FILE else f"--tokens {workload.tokens}"
        raise ConfigError(f"{where}: your model's own loss fails on padding's target "
                          f"{IGNORE} ({theirs_line(e)}); leave it out with ignore_index={IGNORE} "
                          "(cross-entropy's default), or return the logits alone") from None
    _PADDING_CHECKED.add((model, seed))


def shape_model(config) -> nn.Module:
    """The run's model on the meta device: its layers, shapes and parameter counts at any size, with no
    memory and no initialisation, for the checks that only look (a strategy's check(), a prediction).
    A factory that cannot build there (it copies real tensors in) is built for real. Built once for each
    model a process is asked about: the same object again after that, never changed by its readers."""
    names = ("model", "workload", "vocab", "preset", *SHAPE, "seq_len", "aux_loss", "tokens", "twin_blocks",
             "input_shape", "classes", "data", "seed")
    key = (*(str(getattr(config, name, 0)) for name in names), _REAL[0])
    if key not in _META:
        workload = workload_of(config)
        if _REAL[0]:  # built_for_real: a check the meta device refused, again on the CPU
            model = workload.build_model(config.seed)
        else:
            try:
                with torch.device("meta"):
                    model = workload.build_model(config.seed)
            except (RuntimeError, NotImplementedError, TypeError, ValueError):  # it copies real tensors in
                model = workload.build_model(config.seed)
        for k in [k for k in _META if k[-1] == _REAL[0]]:  # one model of each kind kept: one run's at a time
            del _META[k]
        _META[key] = model
    return _META[key]


def their_files() -> set[str]:
    """The source files of the user's models this process built (outputs.model_files): where an exception
    raised in them is theirs, even inside a library (a transformers model's forward)."""
    return userload.BUILT | {f for model in _META.values() for f in outputs.model_files(model)}


_META: dict[tuple, nn.Module] = {}
_REAL = [False]  # shape_model builds for real (built_for_real)
REAL_COPY_MOST = 2**29  # parameters: 2 GiB in fp32, the most a check's real copy may build in the parent


@contextlib.contextmanager
def built_for_real(config):
    """shape_model builds the model on the CPU for real inside: for a check whose forward the meta device
    refuses. Refused (CheckFailed) for a model of more than REAL_COPY_MOST parameters."""
    if (n := sum(p.numel() for p in shape_model(config).parameters())) > REAL_COPY_MOST:
        raise CheckFailed(f"--model {config.model}: a check fails on the meta device, and a real copy of its "
                          f"{n:,} parameters is more than the parent builds ({REAL_COPY_MOST:,})")
    _REAL[0] = True
    try:
        yield
    finally:
        _REAL[0] = False


@functools.lru_cache(maxsize=8)
def _user(spec: str, input_shape: str, classes: int, vocab: int, seq_len: int, data: str,
          twin: int = 0) -> UserWorkload:
    """The user's model and data, checked; `twin` > 0: its shallow twin of that many blocks (its depth
    argument, else a Hugging Face config's num_hidden_layers), checked alike."""
    factory, sizes = userload.load_factory(spec), (("vocab", vocab), ("seq_len", seq_len))
    knob = userload.depth_arg(factory) if twin else ""
    sizes, hf_blocks = (*sizes, (knob, twin)) if knob else sizes, 0 if knob else twin
    found = _found_by_parent(spec, sizes, hf_blocks)
    out = userload.made(factory, 0, spec, sizes, hf_blocks)
    model = out["model"]
    if found is None:
        a, b = model.state_dict(), userload.made(factory, 0, spec, sizes, hf_blocks)["model"].state_dict()
        if a.keys() != b.keys() or not all(torch.equal(a[k], b[k]) for k in a):
            raise ConfigError(f"--model {spec}: two calls with the same seed gave different weights; draw them "
                              "from torch's generator (seeded by the harness) or from the seed it is given")
    label = spec.rpartition(":")[0]
    label = f"{Path(label).name}:{spec.rpartition(':')[2]}" if label.endswith(".py") else spec
    token_file = bool(data) and tokenfile.is_token_file(data)
    if sum(bool(v) for v in (data, input_shape or classes, (vocab or seq_len) and not data)) != 1:
        raise ConfigError(f"--model {label} needs its data: --input-shape and --classes, --vocab and --seq-len, "
                          "or --data FILE (one of them; a token file with --vocab and --seq-len)")
    if token_file:  # its sizes were checked with the batch (userdata.check_batch)
        kind, shape, n_classes, source = "tokens", (seq_len,), vocab, f"--data {data}"
    elif data:
        x, y = userdata.load(data)
        kind, shape, n_classes, source = "file", tuple(x.shape[1:]), 0, f"--data {data}"
        sample_x, sample_y = x[:4], y[:4]
    elif vocab or seq_len:
        if vocab < 2 or seq_len < 1:
            raise ConfigError("--vocab needs at least 2 tokens and --seq-len at least 1")
        kind, shape, n_classes, source = "tokens", (seq_len,), vocab, f"tokens of {vocab} x {seq_len}"
    else:
        if not input_shape or classes < 2:
            raise ConfigError("--input-shape and --classes go together (--classes at least 2)")
        shape = userdata.parse_shape(input_shape, "--input-shape")
        kind, n_classes, source = "teacher", classes, f"inputs {shape}, {classes} classes"
    params = sum(p.numel() for p in model.parameters())
    # Held samples (teacher): at most 64 MB of inputs, batches wrap around them; tokens: drawn per step.
    size = (tokenfile.sequences(data, seq_len) if token_file else len(userdata.load(data)[0])) if data else \
        max(1024, min(8192, 2**24 // math.prod(shape)))
    if isinstance(getattr(type(model), "tp_plan", None), property):  # transformers': read by tp_plan_of
        what = unhonoured_hf_plan(getattr(model, "tp_plan", None), model) or "splits no nn.Linear layer"
        no_plan = f"transformers' own plan for {type(model).__name__} {what}, and the factory returned no 'tp_plan'"
    else:
        no_plan = "the factory returned no 'tp_plan', and the model defines no tp_plan()"
    twin_of = f"; its shallow twin, {twin} block{'s' if twin > 1 else ''}" if twin else ""
    base = dict(name=label, description=f"{type(model).__name__} from {label}, {params / 1e6:.2f}M params{twin_of}",
                make_module=factory, input_shape=shape, classes=n_classes or 10, data=kind, dataset_size=size,
                no_tp_plan=no_plan)
    workload = UserWorkload(**base, spec=spec, factory=factory, sizes=sizes, loss_fn=out.get("loss"), data_file=data,
                            has_plan=out.get("tp_plan") is not None or tp_plan_of(model) is not None,
                            parts_model=hasattr(model, "parts"), causes=tuple(cannot_match(model).values()),
                            tied=tied_names(model), hf_blocks=hf_blocks,
                            tokens=FILE if data and userdata.ignores(data) else "even")
    if found is None:  # the checks that run the model on a sample: in the parent only
        if not data or token_file:
            sample_x, sample_y = workload.dataset(0, 4).batch(0)
        targets, no_logits_loss, sums = outputs.check(label, model, out.get("loss"), sample_x, sample_y, source)
        setattr(model, outputs.KEYWORD, targets)  # so that the layers' check below gets every position's logits
        names, why, from_hf = userchecks.in_order(model, out.get("layers"), sample_x, sample_y)
        found = {"layer_names": names, "no_layers": why, "hf_seq_len": sample_x.shape[1] if from_hf else 0,
                 "targets": targets, "no_logits_loss": no_logits_loss, "sums": sums}
    has_experts, no_experts = experts_of(model)
    return dataclasses.replace(workload, **found, has_experts=has_experts, no_experts=no_experts,
                               aux_weight=max((m.aux_weight for m in moe_layers_of(model) if isinstance(m, MoE)),
                                              default=0.0))


FOUND = "PARALLEL_MODEL_FOUND"  # the parent's findings on a user's model, for its run's children (JSON)
_FINDINGS = ("layer_names", "no_layers", "hf_seq_len", "targets", "no_logits_loss", "sums")


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


def describe(workload: Workload) -> str:
    """One line on what the harness found in a user's model; for the built-in transformer given a shape,
    that shape (empty for the other built-in ones)."""
    if not isinstance(workload, UserWorkload):
        return workload.description if "arch" in dict(workload.model_args) else ""
    layers = (f"pipeline layers {', '.join(workload.layer_names)}" if workload.layer_names
              else f"no pipeline layers: {workload.no_layers}")
    experts = "; experts: parallel.models.moe.MoE layers" if workload.has_experts else ""
    own = f"; trained on its own loss (forward's {workload.targets!r})" if workload.targets else ""
    plan = "yes" if workload.has_plan else "no"
    return "\n".join([f"{workload.description}{own}; {layers}; tensor-parallel plan: {plan}{experts}",
                      *(f"note: {text}" for text in workload.causes)])  # notes: again in a mismatch


def add_arguments(p) -> None:
    """--model and its data's flags, for every command that trains (compare, run, preflight, the scripts)."""
    g = p.add_argument_group("your own model (parallel/models/usermodel.py, examples/)")
    g.add_argument("--model", default="", help="FILE.py:FACTORY or package.module:FACTORY, a function of the seed "
                                               "returning an nn.Module (or a dict: model, loss, layers, tp_plan)")
    g.add_argument("--input-shape", default="", help="one sample's shape for synthetic data, e.g. 3,32,32")
    g.add_argument("--classes", type=int, default=0, help="classes of the synthetic data (with --input-shape)")
    g.add_argument("--vocab", type=int, default=0, help="tokens of synthetic sequences (with --seq-len)")
    g.add_argument("--seq-len", "--seq", type=int, default=0, help="length of synthetic token sequences (with "
                   "--vocab); alone, the built-in transformer's (context parallelism); --seq is plan's spelling")
    g.add_argument("--data", default="", help=".pt or .npz file with x and y, one row per sample (y -100: no "
                                              "target); or a token file, .bin (uint16) or .npy, with --vocab and "
                                              "--seq-len, memory-mapped, each rank reading its own rows")


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
