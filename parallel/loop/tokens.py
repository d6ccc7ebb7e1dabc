"""The global token mean, whatever the split: the loss every strategy is given when batches are uneven
(--tokens padded; docs/loss.md).

One device's loss is the mean over every real token of the global batch: the sum of their losses over
their count N. A strategy cuts the batch into equal pieces (ranks, micro-batches, sequence shards) and
averages what each piece returns, uniformly. Each piece's own mean would weigh a token of a piece with
few real tokens more than one of a piece with many. So each piece returns its sum over N's share of its
size instead:

    piece's loss = sum of its real tokens' losses / (its targets x d),   d = N / the global batch's targets

and the uniform average over J equal pieces is sum / N, the global token mean, with no strategy written
for it: ranks, micro-batches, accumulation and shards alike. d is a per-step count reduced once: every
rank draws the whole global batch (models/data.py), so each computes it from the data and no collective
is needed. A token file (models/tokenfile.py) is read as frameworks read one: each rank its own rows, so
no rank knows N; the loop all-reduces the count of its rows' real targets once a step (`density`), one
small collective on the wire, as torchtitan and nanochat do.
With even batches d = 1 and the loss is cross-entropy's own mean, as it always was."""

from __future__ import annotations

import torch
import torch.distributed as td
import torch.nn.functional as F

from parallel.models.data import IGNORE
from parallel.models.outputs import logits_of, sum_in


class TokenMean:
    """Cross-entropy over logits as a piece of the global token mean; `weigh(d)` before each step."""

    def __init__(self, loss):
        self.loss, self.density = loss, None  # None: the step's batch is even

    def weigh(self, density: float | None) -> None:
        self.density = density

    def __call__(self, output, target: torch.Tensor) -> torch.Tensor:
        if self.density is None:
            return self.loss(output, target)
        if (pair := sum_in(output)) is not None:  # a model's own loss, as its sum over its real targets
            return pair[0] / (target.numel() * self.density)
        logits = logits_of(output)
        total = F.cross_entropy(logits.flatten(0, -2), target.flatten(), ignore_index=IGNORE, reduction="sum")
        return total / (target.numel() * self.density)


def own_mean(loss_fn):
    """What a piece's loss is without the weighing: the mean over its own real tokens (the injected bugs
    that average means do this; docs/loss.md)."""
    return getattr(loss_fn, "loss", loss_fn)


def loss_of(workload):
    """The loss a run's strategies are given: the workload's own, weighed as a piece of the global token
    mean where batches are uneven and the loss is cross-entropy over logits (a model that returns its own
    mean cannot be weighed: docs/loss.md)."""
    uneven = getattr(workload, "tokens", "even") != "even"
    return TokenMean(workload.loss) if uneven and weighable(workload) else workload.loss


def weighable(workload) -> bool:
    """Its loss is cross-entropy over its logits, which TokenMean takes itself (not a factory's own `loss`,
    nor a model's own loss that is something else: label smoothing, an added term), or a model's own loss
    returned as its sum over the real targets and their count (outputs.sum_in), which TokenMean weighs."""
    own_fn = getattr(workload, "loss_fn", None) is not None
    return getattr(workload, "sums", False) or (not workload.no_logits_loss and not own_fn)


COUNT_BYTES = 8  # the count's all-reduce: one float64 a step


def counts_apart(data, loss_fn, world_size: int) -> bool:
    """Does `density` all-reduce the count each step: ranks read their rows apart, and the loss is weighed?"""
    return getattr(data, "per_rank", False) and hasattr(loss_fn, "weigh") and world_size > 1


def density(data, step: int, target: torch.Tensor, shares: int, dist) -> float | None:
    """Global batch `step`'s real targets over its targets. Data every rank draws whole says it itself;
    data read a rank's rows at a time (`per_rank`) is counted here: each rank counts its rows' real targets
    (`target`, this rank's share of `shares`), and one all-reduce sums them. Every share is held by
    world / shares ranks alike (tensor, pipeline and context ranks hold their dp coordinate's), so the sum
    over all ranks is that many times N. Hogwild's workers, which share no group, count the whole step."""
    if not getattr(data, "per_rank", False) or dist.world_size == 1 or not td.is_initialized():
        return data.density(step)
    count = torch.tensor([float((target != IGNORE).sum())], dtype=torch.float64, device=dist.device)
    td.all_reduce(count)  # (1,) the step's real targets, x world / shares
    n = float(count.item()) * shares / dist.world_size
    return n / (target.numel() * shares)
