"""A user's data file (`--data FILE`): a .pt (loaded with weights_only=True) or .npz holding `x` and `y`,
one row per sample, read whole; or a token file (.bin, .npy), memory-mapped and read a rank's rows at a
time (tokenfile.py). The last eighth (at most 2048 samples) is held out for the eval loss and never trained
on; every strategy takes the same batches from the rest, by the same rule as the built-in data. Targets
equal to IGNORE (-100, cross-entropy's ignore_index and Hugging Face's label for padding) do not count:
the loss is then the global token mean (loop/tokens.py). Also the `--input-shape` text of the synthetic
data, read into sizes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from parallel.models import tokenfile
from parallel.models.data import IGNORE, SyntheticData
from parallel.models.tokenfile import HELD_OUT, training_sequences
from parallel.world.errors import ConfigError
from parallel.world.errors import first_line as _first_line


def parse_shape(text: str, what: str) -> tuple[int, ...]:
    """`3,32,32` (or 3x32x32) as sizes, each at least 1; ConfigError naming `what` (the flag) otherwise."""
    try:
        shape = tuple(int(x) for x in text.replace("x", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r}: expected sizes like 3,32,32") from None
    if not shape or min(shape) < 1:
        raise ConfigError(f"{what} {text!r}: expected sizes like 3,32,32, each at least 1")
    return shape


def _read(path: str) -> tuple[torch.Tensor, torch.Tensor]:
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
            raise ConfigError(f"--data {path}: expected a .pt or .npz file of x and y, or a token file (.bin, .npy)")
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

    def __init__(self, workload, seed: int, batch_size: int):  # a userload.UserWorkload
        x, y = load(workload.data_file)
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        keep = training_sequences(len(x))
        self.x, self.y, self._held = x[:keep], y[:keep], (x[keep:], y[keep:])

    def heldout(self, n: int = 2048):
        return self._held

    def real_targets(self, step: int) -> torch.Tensor | None:
        """(B,) the targets that count in each row of global batch `step`; None where every target counts."""
        if not ignores(self.workload.data_file):
            return None
        return (self.batch(step)[1] != IGNORE).reshape(self.batch_size, -1).sum(1)

    def density(self, step: int) -> float | None:
        real = self.real_targets(step)
        return None if real is None else float(real.sum()) / self.y[:self.batch_size].numel()


@functools.lru_cache(maxsize=2)  # asked every step (FileData.real_targets): the whole y scanned once
def ignores(path: str) -> bool:
    """Its targets hold IGNORE somewhere: the harness weighs each piece's loss (loop/tokens.py). A token
    file always goes that way: its ranks read only their rows, and the count is all-reduced."""
    if tokenfile.is_token_file(path):
        return True
    y = load(path)[1]
    return not y.is_floating_point() and bool((y == IGNORE).any())


def check_batch(data: str, batch_size: int, vocab: int = 0, seq_len: int = 0) -> None:
    """A global batch must fit in the file's training samples (batches would repeat samples otherwise)."""
    if tokenfile.is_token_file(data):
        return tokenfile.check(data, vocab, seq_len, batch_size)
    if batch_size > (n := training_sequences(len(load(data)[0]))):
        raise ConfigError(f"--batch-size {batch_size} is more than the {n} samples of --data {data} that are "
                          f"trained on (the last 1/{HELD_OUT} is held out)")


@functools.lru_cache(maxsize=2)
def load(path: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The file's (x, y), read once per process: inputs as float32 (or long), one row per sample."""
    return _read(path)
