"""The models and their deterministic synthetic data.

Each sample is one of 10 random prototypes (smooth 7x7 patterns upsampled, for images) scaled by
SIGNAL, plus unit Gaussian noise; its label comes from a fixed random *teacher*, the prototype with the
largest inner product. So there is something real to learn and the loss genuinely falls (2.30 -> about
2.2 after 23 default steps, near 0 after 80); pure noise labelled by a random linear map did not move
in 60 steps. No data set is downloaded. The same seed gives bitwise the same initial weights and the
same batches in every process and every strategy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel.errors import ConfigError
from parallel.outputs import call, logits_of  # noqa: F401 - logits_of: also read from here (manual_dp, tests)
from parallel.tpplan import TPPlan
from parallel.transformer import MoETransformer, Transformer


def tp_plan_of(model) -> TPPlan | None:
    """The project's tensor-parallel plan of `model`, or None: the factory's (usermodel keeps it in
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


def from_hf_plan(model: nn.Module, plan) -> TPPlan | None:
    """transformers' own tensor-parallel plan ({"model.layers.*.self_attn.q_proj": "colwise", ...}) read
    into the project's: its "colwise" and "rowwise" Linear layers, by full name. Every other style (the
    embedding's, the head's gathered output) is left replicated, which is always correct, and no regions
    are declared, so each split layer sums its own input's gradient (correct whatever the forward passes
    where). None where the model has no such plan (GPT-2's is empty)."""
    if not isinstance(plan, dict) or not plan:
        return None
    import re

    styles = {re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$"): style for pattern, style in plan.items()}
    split = {"colwise": [], "rowwise": []}
    for name, module in model.named_modules():
        for pattern, style in styles.items():
            if style in split and pattern.match(name) and isinstance(module, nn.Linear):
                split[style].append(name)
    return TPPlan(tuple(split["colwise"]), tuple(split["rowwise"])) if split["colwise"] else None


class MLP(nn.Module):
    """A few million parameters and little arithmetic per parameter: communication-heavy.

    512 -> 1024 -> 1024 -> 1024 -> 1024 -> 10: 3.68M parameters, 14.7 MB of fp32 gradients a step.
    """

    def __init__(self, d_in: int = 512, hidden: int = 1024, depth: int = 4, classes: int = 10):
        super().__init__()
        dims = [d_in] + [hidden] * depth
        layers: list[nn.Module] = []
        for a, b in zip(dims[:-1], dims[1:], strict=True):
            layers += [nn.Linear(a, b), nn.ReLU()]
        layers.append(nn.Linear(dims[-1], classes))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):  # (B, 512) -> (B, 10)
        return self.layers(x)

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers forward() runs one after another: what model/pipeline parallelism split."""
        return list(self.layers)

    def tp_plan(self) -> TPPlan:
        """Megatron's pairs: layers 0 and 4 split by columns, 2 and 6 by rows; the last one replicated."""
        return TPPlan(colwise=("layers.0", "layers.4"), rowwise=("layers.2", "layers.6"))


class LeNet(nn.Module):
    """The LeNet-size CNN (28x28x1, conv 6/12, fc 120/60/10): 30k parameters and a lot of
    convolution arithmetic per parameter: compute-heavy."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5), nn.ReLU(), nn.MaxPool2d(2),   # (B, 6, 12, 12)
            nn.Conv2d(6, 12, 5), nn.ReLU(), nn.MaxPool2d(2),  # (B, 12, 4, 4)
            nn.Flatten(),                                       # (B, 192)
        )
        self.classifier = nn.Sequential(
            nn.Linear(12 * 4 * 4, 120), nn.ReLU(),
            nn.Linear(120, 60), nn.ReLU(),
            nn.Linear(60, classes),
        )

    def forward(self, x):  # (B, 1, 28, 28) -> (B, 10)
        return self.classifier(self.features(x))

    def pipeline_layers(self) -> list[nn.Module]:
        """The layers forward() runs one after another: what model/pipeline parallelism split."""
        return [*self.features, *self.classifier]


def gan_update(parts: dict, optimizers, real, z, unsynced=lambda name: contextlib.nullcontext()) -> torch.Tensor:
    """One DCGAN step, the two-optimiser update: the discriminator learns real vs fake, then the
    generator learns to make the discriminator say "real". `parts` may be DDP-wrapped; `unsynced(name)`
    is then that wrapper's no_sync: the discriminator's gradients from the generator's backward are
    thrown away (zeroed before its next step), so all-reducing them would be wasted. -> [d_loss, g_loss]"""
    g, d = parts["generator"], parts["discriminator"]
    bce = F.binary_cross_entropy_with_logits
    ones, zeros = torch.ones(real.shape[0], 1, device=real.device), torch.zeros(real.shape[0], 1, device=real.device)
    fake = g(z)  # (B, 3, 24, 24)
    optimizers["discriminator"].zero_grad(set_to_none=True)
    d_loss = bce(d(torch.cat([real, fake.detach()])), torch.cat([ones, zeros]))  # one forward for both halves
    d_loss.backward()
    optimizers["discriminator"].step()
    optimizers["generator"].zero_grad(set_to_none=True)
    with unsynced("discriminator"):
        g_loss = bce(d(fake), ones)  # the discriminator just updated: the generator chases it
        g_loss.backward()
    optimizers["generator"].step()
    return torch.stack([d_loss.detach(), g_loss.detach()])


class DCGAN(nn.Module):
    """The source material's small DCGAN, for 24x24 RGB images: two models, two optimisers, two losses.

    generator:     z (B, 16, 3, 3) -> ConvT 16->128 k10 -> (B, 128, 12, 12) -> BatchNorm, ReLU
                                   -> ConvT 128->3 k4 s2 p1 -> (B, 3, 24, 24) -> Sigmoid
    discriminator: image (B, 3, 24, 24) -> conv 3->6 k5, ReLU, pool -> (B, 6, 10, 10)
                                        -> conv 6->12 k5, ReLU, pool -> (B, 12, 3, 3) -> fc 108->32, ReLU -> fc 32->1
    The material lists one pool; fc 108 = 12 x 3 x 3 needs the second. The discriminator returns a
    logit (BCE with logits is the stable form of its Sigmoid + BCE).
    """

    LATENT = (16, 3, 3)

    def __init__(self):
        super().__init__()
        self.generator = nn.Sequential(
            nn.ConvTranspose2d(16, 128, 10), nn.BatchNorm2d(128), nn.ReLU(),
            nn.ConvTranspose2d(128, 3, 4, stride=2, padding=1), nn.Sigmoid(),
        )
        self.discriminator = nn.Sequential(
            nn.Conv2d(3, 6, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(6, 12, 5), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(108, 32), nn.ReLU(), nn.Linear(32, 1),
        )

    def forward(self, z):  # (B, 16, 3, 3) -> (B, 3, 24, 24)
        return self.generator(z)

    def parts(self) -> dict[str, nn.Module]:
        """The separately optimised parts: each gets its own optimiser (and, under DDP, its own wrapper)."""
        return {"generator": self.generator, "discriminator": self.discriminator}

    update = staticmethod(gan_update)  # a model with parts brings its own update


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_module: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample
    classes: int = 10  # outputs per sample (per token for the transformer)
    dataset_size: int = 8192  # samples; batches wrap around it like epochs
    data: str = "teacher"  # "teacher": labelled by the nearest prototype; "tokens": a Markov chain; "images": GAN
    loss_names: tuple[str, ...] = ("loss",)
    no_tp_plan: str = ""  # why its model has no tensor-parallel plan (tp_plan()), where it has none
    no_layers: str = ""  # why its model has no pipeline_layers(), where it has none
    tied: str = ""  # the weights its model ties, "a = b" (GPT-2's head and token embedding), where it ties any
    model_args: tuple = ()  # (name, value) pairs make_module is called with: the transformer's context (--seq-len)
    no_experts: str = ""  # why expert parallelism cannot split its model, where it cannot
    no_logits_loss: str = ""  # why its loss is not cross-entropy over its logits (a model's own), where it is not
    depth_arg: str = ""  # the make_module argument that sets its number of blocks, where it has one (the twin's)

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
            return self.make_module(**dict(self.model_args))

    def with_seq_len(self, n: int) -> Workload:
        """The built-in transformer on sequences of n tokens (its context n): what context parallelism
        needs, a sequence long enough to be worth splitting."""
        if self.data != "tokens":
            raise ConfigError(f"--seq-len sets the transformer's sequence length; the {self.name} workload has none")
        if n < 1:
            raise ConfigError(f"--seq-len must be at least 1, got {n}")
        # As many tokens as at the default length (8192 x 32): longer sequences, fewer of them
        size = max(256, self.dataset_size * self.input_shape[0] // n)
        args = (*(a for a in self.model_args if a[0] != "context"), ("context", n))
        return dataclasses.replace(self, input_shape=(n,), model_args=args, dataset_size=size,
                                   description=re.sub(r"x \d+, [\d.]+M params", f"x {n}", self.description))

    def shallow_twin(self, blocks: int) -> Workload:
        """The same model with `blocks` blocks, every width, the vocabulary, context and options as they
        are: what `single` and each strategy's verdict run on when `single` cannot hold the whole model
        (harness/twin.py). ConfigError where the model has no argument for its number of blocks."""
        if not self.depth_arg:
            raise ConfigError(f"the {self.name} workload's model has no number of blocks to set (the transformer's "
                              "and the moe's have)")
        args = (*(a for a in self.model_args if a[0] != self.depth_arg), (self.depth_arg, blocks))
        return dataclasses.replace(self, model_args=args, description=f"{self.description}; its shallow twin, "
                                   f"{blocks} block{'s' if blocks > 1 else ''}")

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
        """Cross-entropy over every prediction: (B, classes) vs (B,), or per token (B, T, V) vs (B, T)."""
        return F.cross_entropy(output.flatten(0, -2), target.flatten())

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


LIKELY = 4  # token data: each token has 4 likely successors (0.2 each), and 0.2 for any token at all
CHAIN = 64  # token data: chains this long, side by side (a vectorised draw a position, whatever T)
SIGNAL = 0.5  # prototype norm over noise norm: learnable in tens of steps at lr 0.02, not in one


def _prototypes(shape: tuple[int, ...], classes: int, g: torch.Generator) -> torch.Tensor:
    """(classes, prod(shape)) random patterns with norm sqrt(d), like the noise; smooth if images."""
    d = math.prod(shape)
    if len(shape) == 3:  # (C, H, W): low-frequency patterns, so convolution and pooling keep them
        coarse = torch.randn((classes, shape[0], 7, 7), generator=g)
        p = F.interpolate(coarse, size=shape[1:], mode="bilinear", align_corners=False).reshape(classes, d)
    else:
        p = torch.randn((classes, d), generator=g)
    return p / p.norm(dim=1, keepdim=True) * math.sqrt(d)


class SyntheticData:
    """A fixed synthetic data set; `batch(step)` is the same tensor everywhere. Per workload.data:
    teacher:  x = SIGNAL x one of 10 prototypes + noise, y = the nearest prototype        (classification)
    tokens:   sequences from a fixed random Markov chain (4 likely successors per token),
              x = tokens 0..T-1, y = tokens 1..T                                         (next-token prediction)
    images:   x = real images, sigmoid(4 x a smooth prototype + noise/2), y = latent z  (the GAN's two inputs)
    """

    def __init__(self, workload: Workload, seed: int, batch_size: int):
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        n = max(workload.dataset_size, batch_size)
        self.teacher, self.x, self.y = _generated(workload, seed, n, torch.get_default_dtype())

    def _samples(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        return _samples(self.workload, self.teacher, n, g)

    def heldout(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """n samples never trained on, from the same teacher: for comparing where strategies ended up. By
        default 2048, or for sequences longer than 32 tokens as many tokens as 2048 x 32 (at least 64
        sequences): a held-out pass over 2048 sequences of 512 tokens took longer than the training. At a
        real vocabulary, at most 2^28 logits in all (at least 16 sequences): 65,536 tokens over GPT-2's
        50,304 took 23 s on this CPU, against 5 s for the whole training of a short run."""
        if not n:
            t = self.workload.input_shape[0] if self.workload.data == "tokens" else 32
            n = max(64, 2048 * 32 // max(32, t))
            if self.workload.data == "tokens":
                n = min(n, max(16, 2**28 // (t * self.workload.classes)))
        return self._samples(n, torch.Generator().manual_seed(20_000 + self.seed))

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s contiguous share of global batch `step` (the whole batch when world_size == 1).
        Shares are equal: callers check that the batch divides (RunConfig.check_divisible)."""
        share = self.batch_size // world_size
        start = step * self.batch_size + rank * share
        idx = torch.arange(start, start + share) % self.x.shape[0]
        return self.x[idx], self.y[idx]


@functools.lru_cache(maxsize=2)
def _generated(workload: Workload, seed: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The teacher and n samples of `workload` for `seed`, in `dtype` (--precision fp64 builds them in
    float64): built once a process, since every run in it (the strategies of one set of ranks, `single`
    for the oracle, the cost model) reads the same ones. Nobody writes to them: batches are copies."""
    g = torch.Generator().manual_seed(10_000 + seed)  # independent of the model's init stream
    if workload.data == "tokens":  # (V, 4): each token's likely successors, V x 4 integers at any vocabulary
        teacher = torch.randint(0, workload.classes, (workload.classes, LIKELY), generator=g)
    else:
        # (classes, d); the GAN's images come from 10 prototypes whatever its 1 "class"
        protos = workload.classes if workload.data == "teacher" else max(workload.classes, 10)
        teacher = _prototypes(workload.input_shape, protos, g)
    return teacher, *_samples(workload, teacher, n, g)


def _samples(workload: Workload, teacher: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    kind = workload.data
    if kind == "tokens":
        # The next token is one of the current token's likely successors with probability 0.8 (each 0.2),
        # else any token. All draws at once, then one gather a position, in chains of at most CHAIN tokens
        # side by side (a long sequence restarts from any token every CHAIN): time and memory ~ n x T.
        t, v = workload.input_shape[0], workload.classes
        chain = min(t + 1, CHAIN)
        chains = n * -(-(t + 1) // chain)
        seq = torch.randint(0, v, (chain, chains), generator=g)  # the starts, and the "any token" draws
        pick = torch.randint(0, LIKELY, (chain - 1, chains), generator=g)
        likely = torch.rand((chain - 1, chains), generator=g) < 0.8
        successors = teacher.view(-1)
        for i in range(chain - 1):  # position-major: each step reads and writes contiguous rows
            seq[i + 1] = torch.where(likely[i], successors[seq[i] * LIKELY + pick[i]], seq[i + 1])
        seq = seq.T.reshape(n, -1)[:, : t + 1]
        return seq[:, :-1], seq[:, 1:]  # (n, T) each
    source = torch.randint(0, teacher.shape[0], (n,), generator=g)
    if kind == "images":
        noise = torch.randn((n, teacher.shape[1]), generator=g)
        x = torch.sigmoid(4 * SIGNAL * teacher[source] + 0.5 * noise)  # in (0, 1), like the generator's
        return x.reshape(n, *workload.input_shape), torch.randn((n, *DCGAN.LATENT), generator=g)
    x = SIGNAL * teacher[source] + torch.randn((n, teacher.shape[1]), generator=g)  # (n, d)
    y = (x @ teacher.T).argmax(dim=1)  # the teacher's label, (n,)
    return x.reshape(n, *workload.input_shape), y


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
