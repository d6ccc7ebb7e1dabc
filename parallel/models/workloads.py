"""The built-in workloads (`WORKLOADS`: nets.py's and transformer.py's models, each with its data), what
each offers the strategies, and their held-out evaluation.

The same seed gives bitwise the same initial weights in every process and every strategy; the data they
train on is parallel/models/data.py's, made from the seed too.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.data import BOS, IGNORE, TOKENS, SyntheticData
from parallel.models.nets import DCGAN, MLP, LeNet
from parallel.models.outputs import call, logits_of  # noqa: F401 - logits_of: also read from here (manual_dp, tests)
from parallel.models.tpplan import TPPlan, head_norm
from parallel.models.transformer import MoETransformer, Transformer
from parallel.world.errors import ConfigError


def tp_plan_of(model) -> TPPlan | None:
    """The project's tensor-parallel plan of `model`, or None: the factory's (userload keeps it in
    `_parallel_tp_plan`), or a tp_plan() method returning a TPPlan. Checked by type, so that a library's
    attribute of the same name (transformers' PreTrainedModel.tp_plan, a dict) is never taken for it."""
    given = getattr(model, "_parallel_tp_plan", None)
    if isinstance(given, TPPlan):
        return given
    method = getattr(type(model), "tp_plan", None)
    if isinstance(method, property):  # transformers: a dict of module patterns -> styles
        return from_hf_plan(model, getattr(model, "tp_plan", None))
    if not callable(method):
        return None
    plan = model.tp_plan()
    return plan if isinstance(plan, TPPlan) else None


def summed_params(model: nn.Module) -> list:
    """The trained parameters of the plan's `summed` modules (TPPlan: a whole weight applied to this rank's
    part), each once (a module named twice, or within another, or a tied weight, would be summed twice)."""
    plan = tp_plan_of(model)
    found = {id(p): p for name in (plan.summed if plan else ()) for p in model.get_submodule(name).parameters()}
    return [p for p in found.values() if p.requires_grad]


def from_hf_plan(model: nn.Module, plan) -> TPPlan | None:
    """transformers' own tensor-parallel plan ({"model.layers.*.self_attn.q_proj": "colwise", ...}) read
    into the project's: its "colwise" and "rowwise" Linear layers, and its "replicated_with_grad_allreduce"
    modules (summed), by full name. The embedding's and the head's styles are left replicated, which is
    correct, and no regions are declared, so each split layer sums its own input's gradient (correct
    whatever the forward passes where). None where the model has no such plan (GPT-2's is empty), or where
    it leaves out what the split needs (unhonoured_hf_plan)."""
    if not isinstance(plan, dict) or not plan:
        return None
    planned = _planned(model, plan)
    if _beside(model, planned):
        return None
    split = {"colwise": [], "rowwise": [], SUMMED: []}
    for name, (module, style) in planned.items():
        if style == SUMMED or isinstance(module, nn.Linear):
            split[style].append(name)
    return TPPlan(tuple(split["colwise"]), tuple(split["rowwise"]), summed=tuple(split[SUMMED])) \
        if split["colwise"] else None


SUMMED = "replicated_with_grad_allreduce"  # a replicated weight applied to split heads (Qwen3's q_norm)


def _planned(model: nn.Module, plan: dict) -> dict[str, tuple[nn.Module, str]]:
    """Every module of `model` a "colwise", "rowwise" or SUMMED pattern of the plan names ("*": a block's
    number), with its style, in the model's order."""
    found = {re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$"): style for pattern, style in plan.items()
             if style in ("colwise", "rowwise", SUMMED)}
    return {name: (module, style) for name, module in model.named_modules()
            for pattern, style in found.items() if pattern.match(name)}


def unhonoured_hf_plan(plan, model: nn.Module | None = None) -> str:
    """What transformers' plan leaves out that the project's split needs, as "the plan ..." would go on, ""
    if nothing: a weight beside the split layers of one module (its attention) that the plan neither splits
    nor marks "replicated_with_grad_allreduce" (transformers 5.0's plan for Qwen3, whose q_norm and k_norm
    5.24 marks so). Left replicated, such a weight gets each rank's part of its gradient only (measured:
    Qwen3's q_norm off by 5.7e4 x the fp64 rule under tensor_parallel at cpu:2, before 5.24's mark was read).
    A norm with a weight per head (Cohere's q_norm) is named so: it needs splitting, not a sum (head_norm)."""
    if not isinstance(plan, dict) or model is None:
        return ""
    beside = _beside(model, _planned(model, plan))
    colwise = [n for n, (_, style) in _planned(model, plan).items() if style == "colwise"]
    return "" if not beside else head_norm(model, beside[0], colwise) or (
        f"leaves {beside[0]}, a weight beside its split layers, replicated, without its gradient summed over the "
        "tensor-parallel ranks")


def _beside(model: nn.Module, planned: dict[str, tuple[nn.Module, str]]) -> list[str]:
    """The children with weights of a module whose layers the plan splits, that the plan names not at all."""
    split = {n for n, (_, style) in planned.items() if style != SUMMED}
    return [f"{o}.{c}" for o in sorted({n.rpartition(".")[0] for n in split})
            for c, m in model.get_submodule(o).named_children()
            if f"{o}.{c}" not in planned and any(True for _ in m.parameters())]


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_module: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample
    classes: int = 10  # outputs per sample (per token for the transformer)
    dataset_size: int = 8192  # samples held (teacher, images; batches wrap around them); tokens are drawn per step
    data: str = "teacher"  # "teacher": labelled by the nearest prototype; "tokens": a Markov chain; "images": GAN
    loss_names: tuple[str, ...] = ("loss",)
    no_tp_plan: str = ""  # why its model has no tensor-parallel plan (tp_plan()), where it has none
    no_layers: str = ""  # why its model has no pipeline_layers(), where it has none
    tied: str = ""  # the weights its model ties, "a = b" (GPT-2's head and token embedding), where it ties any
    model_args: tuple = ()  # (name, value) pairs make_module is called with: the transformer's context (--seq-len)
    no_experts: str = ""  # why expert parallelism cannot split its model, where it cannot
    no_logits_loss: str = ""  # why its loss is not cross-entropy over its logits (a model's own), where it is not
    depth_arg: str = ""  # the make_module argument that sets its number of blocks, where it has one (the twin's)
    tokens: str = "even"  # token data: "even", every position a target; "padded", documents of drawn lengths
    #   padded to the sequence, the padding's targets IGNORE (--tokens; docs/loss.md)

    @property
    def multi_part(self) -> bool:
        """Its model has separately optimised parts and brings its own update (model.parts(),
        model.update): only strategies with MULTI_PART = True train it. Otherwise training is one loss,
        one optimiser: loss(model(x), y)."""
        return hasattr(self.make_module, "parts")

    @property
    def layers(self) -> bool:
        """Its model says which layers forward() runs one after another (model.pipeline_layers())."""
        return hasattr(self.make_module, "pipeline_layers")

    @property
    def tp_plan(self) -> bool:
        """Its model says how to split it for tensor parallelism (model.tp_plan(), a TPPlan)."""
        return hasattr(self.make_module, "tp_plan")

    def build_model(self, seed: int) -> nn.Module:
        """Same seed -> bitwise the same initial weights, whatever ran before in this process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = self.make_module(**dict(self.model_args))
        if self.tokens == "packed":
            model.packed = True  # attention inside each document, positions restarting (transformer.py)
        return model

    def with_seq_len(self, n: int) -> Workload:
        """The built-in transformer on sequences of n tokens (its context n): what context parallelism
        needs, a sequence long enough to be worth splitting."""
        if self.data != "tokens":
            raise ConfigError(f"--seq-len sets the transformer's sequence length; the {self.name} workload has none")
        if n < 1:
            raise ConfigError(f"--seq-len must be at least 1, got {n}")
        args = (*(a for a in self.model_args if a[0] != "context"), ("context", n))
        return dataclasses.replace(self, input_shape=(n,), model_args=args,
                                   description=re.sub(r"x \d+, [\d.]+M params", f"x {n}", self.description))

    def shallow_twin(self, blocks: int) -> Workload:
        """The same model with `blocks` blocks, every width, the vocabulary, context and options as they
        are: what `single` and each strategy's verdict run on when `single` cannot hold the whole model
        (judge/twin.py). ConfigError where the model has no argument for its number of blocks."""
        if not self.depth_arg:
            raise ConfigError(f"the {self.name} workload's model has no number of blocks to set (the transformer's "
                              "and the moe's have)")
        args = (*(a for a in self.model_args if a[0] != self.depth_arg), (self.depth_arg, blocks))
        return dataclasses.replace(self, model_args=args, description=f"{self.description}; its shallow twin, "
                                   f"{blocks} block{'s' if blocks > 1 else ''}")

    def with_tokens(self, mode: str) -> Workload:
        """Its token batches as --tokens says: "even" (every position a target) or "padded" (documents of
        lengths drawn from the seed, their padding's targets IGNORE, left out of the loss)."""
        if mode not in TOKENS:
            raise ConfigError(f"--tokens must be one of {', '.join(TOKENS)}, got {mode!r}")
        if mode != "even" and self.data != "tokens":
            raise ConfigError(f"--tokens {mode} makes uneven token batches; the {self.name} workload has no tokens "
                              "(--workload transformer or moe, or your model with --vocab and --seq-len)")
        if mode == "packed" and self.input_shape[0] < 4:
            raise ConfigError(f"--tokens packed needs sequences of at least 4 tokens to hold documents and their "
                              f"targets, got {self.input_shape[0]}")
        if mode == "packed" and not hasattr(self.make_module, "packed"):
            raise ConfigError(f"--tokens packed needs a model that keeps attention inside each document, from the "
                              f"BOS ({BOS}) each starts with: the built-in transformer's does; the {self.name}'s "
                              "does not (--tokens padded needs nothing of it)")
        return dataclasses.replace(self, tokens=mode)

    def with_aux_loss(self, weight: float) -> Workload:
        """The MoE model with its load-balancing loss at `weight` (--aux-loss)."""
        if not self.experts:
            raise ConfigError(f"--aux-loss weights the routers' load-balancing loss; the {self.name} workload "
                              "has no experts (--workload moe has)")
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"--aux-loss must be 0 (off) or a positive weight, got {weight}")
        return dataclasses.replace(self, model_args=(*self.model_args, ("aux_loss", weight)))

    @property
    def experts(self) -> bool:
        """Its model says where its routed experts are (model.moe_layers()), which expert parallelism splits."""
        return hasattr(self.make_module, "moe_layers")

    @property
    def aux_loss(self) -> float:
        return dict(self.model_args).get("aux_loss", 0.0)

    @property
    def splits_sequence(self) -> bool:
        """Its model says where its attention is (model.attentions()), which context parallelism replaces."""
        return hasattr(self.make_module, "attentions")

    def dataset(self, seed: int, batch_size: int) -> SyntheticData:
        """Where its batches come from: the synthetic data (a user's model may bring a file instead)."""
        return SyntheticData(self, seed, batch_size)

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Cross-entropy over every prediction: (B, classes) vs (B,), or per token (B, T, V) vs (B, T); the
        mean over the targets that count (padding's, IGNORE, left out)."""
        return F.cross_entropy(output.flatten(0, -2), target.flatten(), ignore_index=IGNORE)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
        """Held-out loss: the training loss (cross-entropy, or a user's model's own), or for the GAN how far
        generated images' per-pixel mean and spread are from real ones' (mean squared difference; 0 = the
        same first two moments)."""
        model.eval()
        if self.data != "images":  # the mean over every prediction, a chunk of outputs at a time
            return sum(self.loss(out, t).item() * t.numel() for out, t in in_chunks(model, x, y)) / y.numel()
        fake = model(y)  # y holds the latent vectors
        return (((fake.mean(0) - x.mean(0)) ** 2).mean() + ((fake.std(0) - x.std(0)) ** 2).mean()).item()


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("mlp", "MLP 512-1024x4-10, 3.7M params (communication-heavy)", MLP, (512,)),
        Workload("cnn", "LeNet-size CNN 28x28x1, 30k params (compute-heavy)", LeNet, (1, 28, 28),
                 no_tp_plan="its work is convolutions, which Megatron's column/row split of Linear layers does "
                            "not cover, and its Linear layers (120 and 60 wide, 0.03M parameters) are too "
                            "small to be worth splitting"),
        Workload("transformer", "GPT-style transformer, 2 blocks, width 128, 64 tokens x 32, 0.42M params",
                 Transformer, (32,), classes=64, data="tokens", depth_arg="depth"),
        Workload("moe", "GPT-style transformer, 2 blocks of 4 experts (top-2), width 128, 64 tokens x 32, "
                 "0.68M params", MoETransformer, (32,), classes=64, data="tokens", depth_arg="depth"),
        Workload("dcgan", "DCGAN 24x24x3: generator + discriminator, two optimisers", DCGAN, (3, 24, 24),
                 classes=1, data="images", loss_names=("d_loss", "g_loss"),
                 no_tp_plan="a generator and a discriminator of convolutions"),
    ]
}


@functools.lru_cache(maxsize=4)
def _heldout(workload: Workload, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The teacher depends on the seed only (not on the batch size), so one held-out set serves every row.
    return workload.dataset(seed, 1).heldout()


def _trained(workload: Workload, state: dict[str, torch.Tensor], seed: int) -> nn.Module:
    model = workload.build_model(seed)
    model.load_state_dict(state)
    return model.eval()


def eval_loss(workload: Workload, state: dict[str, torch.Tensor], seed: int) -> float:
    """The held-out loss of parameters `state` (Workload.evaluate): where a strategy's training ended up."""
    return workload.evaluate(_trained(workload, state, seed), *_heldout(workload, seed))


@torch.no_grad()
def accuracy(workload: Workload, state: dict[str, torch.Tensor], seed: int) -> float | None:
    """Share of held-out predictions (samples, or tokens) that are right; None for the GAN."""
    if workload.data == "images":
        return None
    x, y = _heldout(workload, seed)
    model = _trained(workload, state, seed)
    return sum((logits_of(out).argmax(dim=-1) == t).sum().item() for out, t in in_chunks(model, x, y)) / y.numel()


def in_chunks(model: nn.Module, x: torch.Tensor, y: torch.Tensor, most_bytes: int = 1 << 26):
    """(outputs, targets) of model over x a chunk of samples at a time, each chunk's outputs at most
    `most_bytes` (64 MiB: a vocabulary of 128K makes 0.5 MB of logits a token, 34 GB for a held-out set
    of 65,536 tokens at once). A model that takes its targets gets them (outputs.call). Call under no_grad."""
    first = call(model, x[:1], y[:1])
    per = max(1, most_bytes // (logits_of(first).numel() * logits_of(first).element_size()))
    yield first, y[:1]
    for at in range(1, x.shape[0], per):
        yield call(model, x[at:at + per], y[at:at + per]), y[at:at + per]
