"""The models and their deterministic synthetic data.

Each sample is one of 10 random prototypes (smooth 7x7 patterns upsampled, for images) scaled by
SIGNAL, plus unit Gaussian noise; its label comes from a fixed random *teacher*, the prototype with the
largest inner product. So there is something real to learn and the loss genuinely falls (2.30 -> about
2.2 after 23 default steps, near 0 after 80); pure noise labelled by a random linear map did not move
in 60 steps. No data set is downloaded. The same seed gives bitwise the same initial weights and the
same batches in every process and every strategy.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


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


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    make_module: Callable[[], nn.Module]
    input_shape: tuple[int, ...]  # one sample
    classes: int = 10
    dataset_size: int = 8192  # samples; batches wrap around it like epochs

    def build_model(self, seed: int) -> nn.Module:
        """Same seed -> bitwise the same initial weights, whatever ran before in this process."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return self.make_module()

    @staticmethod
    def loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output, target)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("mlp", "MLP 512-1024x4-10, 3.7M params (communication-heavy)", MLP, (512,)),
        Workload("cnn", "LeNet-size CNN 28x28x1, 30k params (compute-heavy)", LeNet, (1, 28, 28)),
    ]
}


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
    """A fixed synthetic data set with teacher labels; `batch(step)` is the same tensor everywhere."""

    def __init__(self, workload: Workload, seed: int, batch_size: int):
        g = torch.Generator().manual_seed(10_000 + seed)  # independent of the model's init stream
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        self.teacher = _prototypes(workload.input_shape, workload.classes, g)  # (classes, d)
        self.x, self.y = self._samples(max(workload.dataset_size, batch_size), g)

    def _samples(self, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        source = torch.randint(0, self.workload.classes, (n,), generator=g)
        x = SIGNAL * self.teacher[source] + torch.randn((n, self.teacher.shape[1]), generator=g)  # (n, d)
        y = (x @ self.teacher.T).argmax(dim=1)  # the teacher's label, (n,)
        return x.reshape(n, *self.workload.input_shape), y

    def heldout(self, n: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
        """n samples never trained on, from the same teacher: for comparing where strategies ended up."""
        return self._samples(n, torch.Generator().manual_seed(20_000 + self.seed))

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s contiguous share of global batch `step` (the whole batch when world_size == 1).
        Shares are equal: callers check that the batch divides (RunConfig.check_divisible)."""
        share = self.batch_size // world_size
        start = step * self.batch_size + rank * share
        idx = torch.arange(start, start + share) % self.x.shape[0]
        return self.x[idx], self.y[idx]


@functools.lru_cache(maxsize=4)
def _heldout(workload_name: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    # The teacher depends on the seed only (not on the batch size), so one held-out set serves every row.
    return SyntheticData(WORKLOADS[workload_name], seed, 1).heldout()


@torch.no_grad()
def eval_loss(workload: Workload, state: dict[str, torch.Tensor], seed: int) -> float:
    """The loss of parameters `state` on the held-out samples: where a strategy's training ended up."""
    model = workload.build_model(seed)
    model.load_state_dict(state)
    x, y = _heldout(workload.name, seed)
    return workload.loss(model.eval()(x), y).item()
