"""The small built-in models: an MLP (communication-heavy), a LeNet-size CNN (compute-heavy) and a DCGAN
(two parts, two optimisers, its own update). workloads.py lists them, with the transformers, in WORKLOADS.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.tpplan import TPPlan


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
