"""A token file as `--data` (`--data train.bin --vocab V --seq-len T`): one flat array of token ids, as
nanoGPT's prepare.py writes `train.bin` (uint16, no header), or a `.npy` (its header names the dtype:
uint16, int32 or int64). It is memory-mapped, never read whole, so a file larger than memory works.

    sequence i = tokens[i T : i T + T + 1]      x = its first T, y = its last T (Megatron's cut: each
                                                 token but the first is a target exactly once)

Each rank reads only its own rows of each step (`batch`): a DataLoader over a DistributedSampler, or
nanoGPT's get_batch, reads no more. A step's count of real targets is then known to no rank alone, so
the loop all-reduces it once a step (loop/tokens.py). In a signed file, -100 (cross-entropy's
ignore_index, Hugging Face's label for padding) marks a position that is no target: as an input it is
read as token 0, as a target it is IGNORE. The last eighth of the sequences (at most 2048, and no more
logits than the synthetic tokens' held-out set) is held out for the eval loss and never trained on.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from parallel.models.data import IGNORE, PAD
from parallel.world.errors import ConfigError
from parallel.world.errors import first_line as _first_line

SUFFIXES = (".bin", ".npy")
DTYPES = ("uint16", "int32", "int64")  # what a .npy may hold; a .bin is uint16, as nanoGPT writes it
HELD_OUT = 8  # a data file's last 1/HELD_OUT (at most 2048 samples or sequences) is the held-out set


def is_token_file(path: str) -> bool:
    return Path(path).suffix in SUFFIXES


@functools.lru_cache(maxsize=4)
def tokens(path: str) -> np.ndarray:
    """The file's tokens, memory-mapped read-only (nothing is read until a batch asks for it)."""
    p = Path(path)
    try:
        if p.suffix == ".npy":
            flat = np.load(p, mmap_mode="r", allow_pickle=False)
        else:
            if p.stat().st_size % 2:
                raise ConfigError(f"--data {path}: {p.stat().st_size} bytes is not a whole number of uint16 tokens "
                                  "(a .bin is read as nanoGPT writes it: uint16, no header; save any other dtype as "
                                  ".npy, which records it)")
            flat = np.memmap(p, dtype=np.uint16, mode="r")
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - not a .npy, or unreadable
        raise ConfigError(f"--data {path}: cannot read its tokens ({_first_line(e)})") from None
    if flat.dtype.name not in DTYPES:
        raise ConfigError(f"--data {path}: holds {flat.dtype.name}; token ids are {', '.join(DTYPES)}")
    if flat.ndim != 1:
        raise ConfigError(f"--data {path}: holds an array of shape {flat.shape}; a token file is one flat array "
                          "(documents one after another)")
    return flat


def sequences(path: str, seq_len: int) -> int:
    """How many sequences of `seq_len` tokens (and the target after the last) the file holds."""
    return max(0, (len(tokens(path)) - 1) // seq_len)


def training_sequences(n: int) -> int:
    """Of a data file's n samples or sequences, those trained on: all but the held-out last eighth (at most
    2048); a .pt's and a token file's alike (userdata.py)."""
    return n - min(2048, n // HELD_OUT)


def check(path: str, vocab: int, seq_len: int, batch_size: int) -> None:
    """One line for a file that cannot serve the run: too short, or tokens outside the vocabulary among
    its first sequences (all of a small file; a large one's later batches are checked as they are read)."""
    if seq_len < 1 or vocab < 2:
        raise ConfigError(f"--data {path} is a token file: give --vocab (at least 2) and --seq-len (at least 1), "
                          "how its tokens are read and cut into sequences")
    n = sequences(path, seq_len)
    if (train := training_sequences(n)) < batch_size or n < 2 * HELD_OUT:  # 1/8 held out: at least one
        raise ConfigError(f"--data {path}: {len(tokens(path)):,} tokens make {n:,} sequences of {seq_len} "
                          f"({train:,} trained on, 1/{HELD_OUT} held out); --batch-size {batch_size} needs "
                          f"{batch_size:,} to train on")
    head = np.asarray(tokens(path)[: min(len(tokens(path)), 1 << 22)])
    _in_range(path, head, vocab)
    if tokens(path).dtype == np.uint16 and len(head) >= 64 and not head[1::2].any() and head[0::2].any():
        raise ConfigError(f"--data {path}: every second uint16 token is 0, as int32 tokens read as uint16 are; "
                          "save them as .npy, which records their dtype")


def _in_range(path: str, t: np.ndarray, vocab: int, position: np.ndarray | None = None) -> None:
    """ConfigError naming the first token outside the vocabulary (IGNORE aside) and its position in the file."""
    real = t[t != IGNORE] if t.dtype.kind == "i" else t
    if real.size and (int(real.min()) < 0 or int(real.max()) >= vocab):
        bad = np.argmax(((t >= vocab) | ((t < 0) & (t != IGNORE))).reshape(-1))
        at = int(bad if position is None else position.reshape(-1)[bad])
        raise ConfigError(f"--data {path}: token {int(t.reshape(-1)[bad])} at position {at:,} is outside --vocab "
                          f"{vocab} (ids 0 to {vocab - 1}; {IGNORE} marks a position that is no target)")


class TokenFile:
    """The interface of models/data.SyntheticData over a token file: `batch(step, rank, world_size)` reads
    that rank's rows alone; `real_targets`/`density` read the whole step's targets (the parent's note, and
    Hogwild's workers, which share no group to all-reduce a count in)."""

    per_rank = True  # a step's count of real targets is all-reduced by the loop (loop/tokens.py)

    def __init__(self, workload, seed: int, batch_size: int):  # a userload.UserWorkload
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        self.path, self.t = workload.data_file, workload.input_shape[0]
        self.n = sequences(self.path, self.t)
        self.train = training_sequences(self.n)

    def _rows(self, which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequences `which` as (x, y), (len(which), T) each: only their tokens are read from the file."""
        position = which[:, None] * self.t + np.arange(self.t + 1)
        seq = np.asarray(tokens(self.path)[position])
        _in_range(self.path, seq, self.workload.classes, position)
        seq = torch.from_numpy(seq.astype(np.int64))
        x, y = seq[:, :-1], seq[:, 1:]
        return x.masked_fill(x == IGNORE, PAD).contiguous(), y.contiguous()

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        share = self.batch_size // world_size
        first = step * self.batch_size + rank * share
        return self._rows(np.arange(first, first + share) % self.train)  # epochs: the training sequences again

    def real_targets(self, step: int) -> torch.Tensor | None:
        """(B,) the targets that count in each row of global batch `step`: all of them in an unsigned file."""
        if tokens(self.path).dtype.kind == "u":
            return torch.full((self.batch_size,), self.t)
        return (self.batch(step)[1] != IGNORE).sum(1)

    def density(self, step: int) -> float:
        return float(self.real_targets(step).sum()) / (self.batch_size * self.t)

    def heldout(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """The held-out sequences (the last ones), no more logits than 2^26 in all (at least 4 sequences)."""
        most = max(4, 2**26 // (self.t * self.workload.classes))
        return self._rows(np.arange(self.train, min(self.n, self.train + most)))
