"""The optimiser every strategy steps with, built from the run's flags (docs/optimizer.md):

    --optimizer sgd    torch.optim.SGD with momentum (--momentum), L2 --weight-decay if given
    --optimizer adamw  torch.optim.AdamW (--betas, decoupled --weight-decay): what transformers train with
    --optimizer muon   torch.optim.Muon on the hidden matrices, AdamW on the rest (loop/muon.py)

Which parameters decay is decided once, on the model as the workload built it, before any strategy
wraps it, by one stated rule, by what a parameter IS, never by its name:

    matrix     a 2-D weight inside the model (attention, MLP)   decays
    head       the 2-D weight that maps to the outputs          decays
    tensor     a weight of 3 or more dimensions (convolutions)  decays
    embedding  a weight of an nn.Embedding (and a head tied to it) does not decay
    vector     1-D: norms' scales, every bias                   does not decay

`tag` writes each parameter's kind onto the parameter itself, so the rule travels with it through every
wrapper that keeps its parameters (DDP, pipeline stages) whatever they rename them. A wrapper that makes
new parameters (FSDP2's and DTensor's, a split head) is entered under `kept`, which writes each kind
again by the name it had inside that module just before. A strategy that makes tensors of its own for
the optimiser (ZeRO's flat chunks) names their kind itself (`tag_as`): one kind a chunk, so a flat buffer
never mixes the two (DeepSpeed flattens each parameter group apart for the same reason).

The learning rate follows --lr-schedule: constant, or cosine (from --lr down to MIN_LR_FACTOR of it over the
run's steps), after --warmup-steps of linear warm-up from 1/W of it; torch's LambdaLR steps it once per
optimiser step (loop/clipping.py's Step).
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

KIND = "_parallel_kind"  # the attribute a parameter carries its kind in
DECAYS = ("matrix", "head", "tensor")
KINDS = ("matrix", "head", "tensor", "embedding", "vector")
MIN_LR_FACTOR = 0.1  # cosine ends at a tenth of --lr, as nanoGPT's and Llama's schedules do
OPTIMIZERS = ("sgd", "adamw", "muon")
SCHEDULES = ("constant", "cosine")
DEFAULTS = {  # what a flag left out means, by optimizer: (lr, weight decay, clip norm)
    "sgd": (0.02, 0.0, 0.0),
    "adamw": (3e-3, 0.1, 1.0),
    "muon": (3e-3, 0.1, 1.0),  # AdamW's: Muon's step is scaled to AdamW's size (loop/muon.py)
}


def tag(model: nn.Module, outputs: int) -> dict[str, str]:
    """Give every parameter of `model` its kind (the rule above), `outputs` the model's outputs per sample
    (the vocabulary, the classes): the last 2-D weight with that many rows is the head. Returns the kinds
    by name, which the docs and tests read."""
    owners: dict[int, list[nn.Module]] = {}
    named: dict[int, tuple[str, nn.Parameter]] = {}
    for module_name, module in model.named_modules():
        for leaf, p in module.named_parameters(recurse=False):
            owners.setdefault(id(p), []).append(module)
            named.setdefault(id(p), (f"{module_name}.{leaf}".lstrip("."), p))
    head = next((i for i, (_, p) in reversed(named.items()) if p.ndim == 2 and p.shape[0] == outputs), None)
    kinds = {}
    for i, (name, p) in named.items():
        kind = "embedding" if any(isinstance(m, nn.Embedding) for m in owners[i]) else \
            "vector" if p.ndim < 2 else "head" if i == head else "matrix" if p.ndim == 2 else "tensor"
        tag_as(p, kind)
        kinds[name] = kind
    return kinds


def tag_as(p: torch.Tensor, kind: str) -> torch.Tensor:
    setattr(p, KIND, kind)
    return p


def like(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """`new`, a parameter made from `old` (a slice, a copy), of `old`'s kind."""
    return tag_as(new, getattr(old, KIND)) if hasattr(old, KIND) else new


def kind_of(p: torch.Tensor) -> str:
    kind = getattr(p, KIND, None)
    if kind is None:  # a wrapper made it outside `kept`: a bug of ours, never the user's
        raise RuntimeError(f"a parameter of shape {tuple(p.shape)} reached the optimizer without a kind "
                           "(loop/optim.tag): the strategy made it without optim.kept")
    return kind


@contextlib.contextmanager
def kept(module: nn.Module):
    """Around a wrapper that replaces `module`'s parameters with new ones (fully_shard, parallelize_module):
    each new parameter gets the kind the old one of its name had."""
    before = {name: getattr(p, KIND, None) for name, p in module.named_parameters()}
    yield
    for name, p in module.named_parameters():
        if getattr(p, KIND, None) is None and before.get(name) is not None:
            tag_as(p, before[name])


def decays(p: torch.Tensor) -> bool:
    return kind_of(p) in DECAYS


def by_name(named, rule: dict[str, str]) -> list[torch.Tensor]:
    """The injected bug's way (ddp:decay-by-wrapped-name): kinds looked up by the names the wrapper shows,
    as a list of no-decay names made from the model before it was wrapped; a name the wrapper changed is
    not found and its parameter decays."""
    return [tag_as(p, rule.get(name, "matrix")) for name, p in named]


class Recipe:
    """The run's optimiser, settings resolved (RunConfig.validate): call it on what torch's optimisers
    take (parameters, or groups of them as dicts) for the optimiser; `groups` splits them by decay."""

    def __init__(self, config):
        if config.lr is None or config.weight_decay is None or not config.optimizer:
            raise RuntimeError("internal: Recipe of a RunConfig not validated (its optimiser, lr or decay unset)")
        self.name, self.lr, self.clip = config.optimizer, config.lr, config.clip_norm
        self.weight_decay, self.momentum = config.weight_decay, config.momentum
        self.betas = tuple(float(b) for b in config.betas.split(","))
        self.lr_schedule, self.warmup_steps = config.lr_schedule, config.warmup_steps
        self.total = config.warmup + config.steps  # every optimiser step of the run, the untimed ones too
        self.master = config.precision == "bf16-master"  # bf16 weights stepped through fp32 masters

    @property
    def cls(self) -> type[torch.optim.Optimizer]:
        from parallel.loop import master
        from parallel.loop.muon import MuonAdamW

        cls = {"adamw": torch.optim.AdamW, "muon": MuonAdamW}.get(self.name, torch.optim.SGD)
        return master.of(cls) if self.master else cls

    @property
    def defaults(self) -> dict:
        if self.name in ("adamw", "muon"):
            return {"lr": self.lr, "betas": self.betas, "weight_decay": self.weight_decay}
        return {"lr": self.lr, "momentum": self.momentum, "weight_decay": self.weight_decay}

    def part(self, p: torch.Tensor) -> str:
        """Which of the optimiser's groups p falls in: "muon" (Muon's matrices), "decay" or "no-decay"."""
        return "muon" if self.name == "muon" and kind_of(p) == "matrix" else "decay" if decays(p) else "no-decay"

    def groups(self, params) -> list[dict]:
        """Each group given (a bare list is one) cut by `part`: Muon's matrices (under muon), what decays, at
        --weight-decay, and what does not, at 0; each keeps the keys it came with (tensor_parallel.by_kind's
        mesh groups)."""
        given = list(params)
        given = given if given and isinstance(given[0], dict) else [{"params": given}]
        out = []
        for group in given:
            tensors = [p[1] if isinstance(p, tuple) else p for p in group["params"]]
            rest = {k: v for k, v in group.items() if k != "params"}
            for part in ("muon", "decay", "no-decay"):
                chosen = [p for p in tensors if self.part(p) == part]
                if chosen:
                    out.append({**rest, "params": chosen, "weight_decay": 0.0 if part == "no-decay" else
                                self.weight_decay} | ({"muon": True} if part == "muon" else {}))
        return out

    def __call__(self, params) -> torch.optim.Optimizer:
        return self.cls(self.groups(params), **self.defaults)

    def factor(self, step: int) -> float:
        """The learning rate of optimiser step `step` (0-based) over --lr."""
        w = self.warmup_steps
        if step < w:
            return (step + 1) / w
        if self.lr_schedule == "constant":
            return 1.0
        t = min(1.0, (step - w) / max(1, self.total - w))
        return MIN_LR_FACTOR + (1 - MIN_LR_FACTOR) * 0.5 * (1 + math.cos(math.pi * t))


def moments(config, params=()) -> float:
    """Buffers of a parameter's size the optimiser keeps per parameter: SGD's momentum, AdamW's two; Muon's
    one on the matrices and AdamW's two on the rest, averaged over `params` (tagged; none given: 2)."""
    if config.optimizer == "muon":
        sizes = [(p.numel(), kind_of(p) == "matrix") for p in params]
        total = sum(n for n, _ in sizes)
        return (2 * total - sum(n for n, matrix in sizes if matrix)) / total if total else 2
    return 2 if config.optimizer == "adamw" else int(config.momentum > 0)


def state_now(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """`p`'s optimiser state by name, made now where the optimiser has not yet made it (it does at its first
    step), as it would: zeros, and AdamW's step count 0 (a scalar of torch's _get_scalar_dtype: float64 under
    a float64 default). What a checkpoint of the live tensors writes before the first step, and what DCP
    loads into on a resume. The first step from these zeros is the step torch takes from none."""
    if (master_of := getattr(optimizer, "master_of", None)) is not None:
        master_of(p)  # bf16-master: the fp32 master, made now as its first step would (loop/master.py)
    state = optimizer.state[p]
    group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
    fresh = not set(state) - {"master"}
    like = state.get("master", p)  # the moments are the master's dtype: fp32 under bf16 weights
    if fresh and group.get("muon"):
        state["momentum_buffer"] = torch.zeros_like(like)
    elif fresh and "betas" in group:  # AdamW, on its own or for Muon's rest
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        state.update(step=torch.tensor(0.0, dtype=scalar), exp_avg=torch.zeros_like(like),
                     exp_avg_sq=torch.zeros_like(like))
    elif fresh and group.get("momentum"):  # SGD's buffer: the first step makes it the gradient
        state["momentum_buffer"] = torch.zeros_like(like)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


def make_optimizer(config) -> Recipe:
    """The optimiser every strategy uses, from the config: a function of parameters (or groups)."""
    return Recipe(config)


def resolve(optimizer: str, lr: float | None, weight_decay: float | None, clip: float | None,
            transformer: bool) -> tuple[str, float, float, float]:
    """The flags a user left out, filled: AdamW where a transformer trains, SGD elsewhere (docs/optimizer.md),
    then that optimiser's lr, weight decay and clip."""
    name = optimizer or ("adamw" if transformer else "sgd")
    d_lr, d_wd, d_clip = DEFAULTS.get(name, DEFAULTS["sgd"])
    return name, d_lr if lr is None else lr, d_wd if weight_decay is None else weight_decay, \
        d_clip if clip is None else clip
