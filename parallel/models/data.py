"""The synthetic data every strategy trains on, made from the seed in every process: nothing is
downloaded, and each rank of each strategy takes its share of the same global batches.

Per `workload.data`:
  teacher  x = SIGNAL x one of 10 random prototypes + unit noise, y = the nearest prototype
           (classification); `dataset_size` samples drawn once and held (16 MB for the MLP)
  images   the GAN's two inputs: real images, sigmoid(4 x SIGNAL x a smooth prototype + noise/2), and
           latent vectors z; held likewise
  tokens   a fixed random Markov chain, of which only the V x LIKELY table of likely successors is held;
           global batch `step` is drawn when asked, from a generator seeded by (seed, step): time and
           memory ~ the batch, at any vocabulary (x = tokens 0..T-1, y = tokens 1..T)

Why a teacher: pure noise labelled by a random linear map did not move in 60 steps; prototypes do (2.30 ->
about 2.2 after 23 default steps, near 0 after 80). The token chain's loss falls towards its entropy.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

LIKELY = 4  # token data: each token has 4 likely successors (0.2 each), and 0.2 for any token at all
CHAIN = 64  # token data: chains this long, side by side (a vectorised draw a position, whatever T)
SIGNAL = 0.5  # prototype norm over noise norm: learnable in tens of steps at lr 0.02, not in one
TRAIN, HELDOUT, LENGTHS = 0, 1, 2  # token data's streams: (seed, TRAIN, step), (seed, HELDOUT, 0), and the
#   documents' lengths of a padded batch, (seed, LENGTHS, step): even batches draw exactly what they did
TOKENS = ("even", "padded", "packed")  # --tokens: every position a target, documents padded to the sequence,
#   or documents packed one after another into it (each starting with BOS)
FILE = "file"  # a workload's tokens as a user's --data file gives them: IGNORE wherever its targets do not count
IGNORE = -100  # a target that does not count (padding): cross-entropy's ignore_index, torch's default
PAD = 0  # the input token at a padded position (its target is IGNORE, so what it is changes no loss)
BOS = 0  # packed: the token a document starts with (the chain's own 0s become 1s); the next document's
#   BOS is no target of the one before it (IGNORE)


class SyntheticData:
    """`batch(step, rank, world_size)` is the same tensor in every process and strategy; `heldout()` is
    never trained on. `workload` is a parallel.models.workloads.Workload (its data, input_shape, classes)."""

    def __init__(self, workload, seed: int, batch_size: int):
        self.workload, self.seed, self.batch_size = workload, seed, batch_size
        if workload.data == "tokens":  # the chain alone: batches are drawn per step
            self.teacher = _chain(workload.classes, seed)
        else:
            n = max(workload.dataset_size, batch_size)
            self.teacher, self.x, self.y = _generated(workload, seed, n, torch.get_default_dtype())

    def heldout(self, n: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """n samples never trained on, from the same teacher: for comparing where strategies ended up. By
        default 2048 samples (512 images for the GAN), or as many tokens as 512 x 32 (at least 16 sequences).
        The parent evaluates every row: 2048 sequences of 32 tokens took 2.3 s a row for the 0.4M-parameter
        transformer and 2048 images 2.0 s for the GAN's generator, more than the suite's runs train (512:
        0.6 s); a pass over 2048 sequences of 512 tokens took longer than the training. At a real
        vocabulary, at most 2^26 logits in all (at least 4 sequences): 65,536 tokens over GPT-2's 50,304
        took 23 s on this CPU; 20 sequences of 256 (2^28) still took 7 s a row, where 5 take under 2 s (a
        row's step is 10 s)."""
        tokens = self.workload.data == "tokens"
        if not n:
            t = self.workload.input_shape[0] if tokens else 32
            n = max(16, 512 * 32 // max(32, t)) if tokens else 512 if self.workload.data == "images" else 2048
            if tokens:
                n = min(n, max(4, 2**26 // (t * self.workload.classes)))
        if tokens:
            seq = _sequences(self.teacher, n, self.workload.input_shape[0], _stream(self.seed, HELDOUT, 0))
            if getattr(self.workload, "tokens", "even") == "packed":  # one document a row, as a packed model reads
                begin = torch.zeros_like(seq, dtype=torch.bool)
                begin[:, 0] = True
                return _packed(seq, begin)
            return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()  # as a DataLoader gives them: a .view works
        return _samples(self.workload, self.teacher, n, torch.Generator().manual_seed(20_000 + self.seed))

    def real_targets(self, step: int) -> torch.Tensor | None:
        """(B,) the targets that count in each row of global batch `step`, None where every one does."""
        tokens, t = getattr(self.workload, "tokens", "even"), self.workload.input_shape[0]
        if tokens == "padded":
            return lengths(self.seed, step, self.batch_size, t)
        if tokens == "packed":  # every position a target but those whose next token starts a document
            return t - starts(self.seed, step, self.batch_size, t)[:, 1:].sum(1)
        return None

    def density(self, step: int) -> float | None:
        """Global batch `step`'s real targets over its targets (loop/tokens.py), None where every one is."""
        real = self.real_targets(step)
        return None if real is None else real.sum().item() / (self.batch_size * self.workload.input_shape[0])

    def batch(self, step: int, rank: int = 0, world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Rank `rank`'s contiguous share of global batch `step` (the whole batch when world_size == 1).
        Shares are equal: callers check that the batch divides (RunConfig.check_divisible).

        Held data: samples step*B .. step*B+B-1, wrapping around the data set like epochs. Tokens: every
        rank draws the whole global batch from (seed, step), whatever the world size, and keeps its rows;
        no epochs, since a step's draw costs the same at any step and repeating them would buy nothing."""
        share = self.batch_size // world_size
        first = rank * share
        if self.workload.data == "tokens":
            t = self.workload.input_shape[0]
            seq = _sequences(self.teacher, self.batch_size, t, _stream(self.seed, TRAIN, step))  # (B, T + 1)
            x, y = seq[first:first + share, :-1].contiguous(), seq[first:first + share, 1:].contiguous()
            tokens = getattr(self.workload, "tokens", "even")
            if tokens == "padded":
                x, y = _padded(x, y, lengths(self.seed, step, self.batch_size, t)[first:first + share])
            elif tokens == "packed":
                begins = starts(self.seed, step, self.batch_size, t)[first:first + share]
                x, y = _packed(seq[first:first + share], begins)
            return x, y
        idx = torch.arange(step * self.batch_size + first, step * self.batch_size + first + share) % self.x.shape[0]
        return self.x[idx], self.y[idx]


def lengths(seed: int, step: int, batch_size: int, t: int) -> torch.Tensor:
    """(B,) the documents' lengths of padded global batch `step`: each drawn uniformly from 1 to T, so
    that ranks, micro-batches and sequence shards hold different numbers of real tokens."""
    return torch.from_numpy(_stream(seed, LENGTHS, step).integers(1, t + 1, batch_size))


def starts(seed: int, step: int, batch_size: int, t: int) -> torch.Tensor:
    """(B, T + 1) bool: where a document starts in each packed sequence of global batch `step` (position 0
    always), the documents' lengths drawn uniformly from 1 to T, one after another."""
    length = torch.from_numpy(_stream(seed, LENGTHS, step).integers(1, t + 1, (batch_size, t + 1)))
    at = torch.cat((torch.zeros(batch_size, 1, dtype=length.dtype), length.cumsum(1)[:, :-1]), dim=1)
    out = torch.zeros(batch_size, t + 2, dtype=torch.bool)
    out.scatter_(1, at.clamp(max=t + 1), True)
    return out[:, : t + 1]


def _packed(seq: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Documents one after another: BOS where each starts, the chain's own BOS tokens made 1; the target
    before a BOS is IGNORE (no document predicts the next one's start)."""
    seq = seq.masked_fill(seq == BOS, 1).masked_fill(start, BOS)
    x, y = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return x, y.masked_fill(start[:, 1:], IGNORE)


def _padded(x: torch.Tensor, y: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's document, `length` tokens long, then padding: PAD as input, IGNORE as target."""
    pad = torch.arange(x.shape[1]) >= length[:, None]
    return x.masked_fill(pad, PAD), y.masked_fill(pad, IGNORE)


def _stream(seed: int, kind: int, index: int) -> np.random.Generator:
    """The token draws' generator for (seed, kind, index): numpy's PCG64 through SeedSequence, which takes
    the three words as they are. torch's CPU generator keeps only a seed's low 32 bits (manual_seed(7) and
    manual_seed(7 + 2**32) draw the same, torch 2.13), so (seed, step) would have to be squeezed into one
    word, and two steps could share their batch."""
    return np.random.default_rng([seed, kind, index])


@functools.lru_cache(maxsize=4)
def _chain(vocab: int, seed: int) -> torch.Tensor:
    """(V, LIKELY): each token's likely successors, V x 4 integers (4 MB at 128,256), never the V x V
    matrix of transition probabilities. Built once a process; nobody writes to it."""
    g = torch.Generator().manual_seed(10_000 + seed)  # independent of the model's init stream
    return torch.randint(0, vocab, (vocab, LIKELY), generator=g)


def _sequences(successors: torch.Tensor, n: int, t: int, rng: np.random.Generator) -> torch.Tensor:
    """(n, t + 1) tokens of the chain. The next token is one of the current token's likely successors
    with probability 0.8 (each 0.2), else any token. All draws at once, then one gather a position, in
    chains of at most CHAIN tokens side by side (a long sequence restarts from any token every CHAIN):
    time and memory ~ n x t, whatever the vocabulary."""
    chain = min(t + 1, CHAIN)
    chains = n * -(-(t + 1) // chain)
    seq = torch.from_numpy(rng.integers(0, successors.shape[0], (chain, chains)))  # starts and "any token"s
    pick = torch.from_numpy(rng.integers(0, LIKELY, (chain - 1, chains)))
    likely = torch.from_numpy(rng.random((chain - 1, chains), dtype=np.float32) < 0.8)
    flat = successors.view(-1)
    for i in range(chain - 1):  # position-major: each step reads and writes contiguous rows
        seq[i + 1] = torch.where(likely[i], flat[seq[i] * LIKELY + pick[i]], seq[i + 1])
    return seq.T.reshape(n, -1)[:, : t + 1]


def _prototypes(shape: tuple[int, ...], classes: int, g: torch.Generator) -> torch.Tensor:
    """(classes, prod(shape)) random patterns with norm sqrt(d), like the noise; smooth if images."""
    d = math.prod(shape)
    if len(shape) == 3:  # (C, H, W): low-frequency patterns, so convolution and pooling keep them
        coarse = torch.randn((classes, shape[0], 7, 7), generator=g)
        p = F.interpolate(coarse, size=shape[1:], mode="bilinear", align_corners=False).reshape(classes, d)
    else:
        p = torch.randn((classes, d), generator=g)
    return p / p.norm(dim=1, keepdim=True) * math.sqrt(d)


@functools.lru_cache(maxsize=2)
def _generated(workload, seed: int, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The teacher and n samples of a teacher or images workload for `seed`, in `dtype` (--precision fp64
    builds them in float64): built once a process, since every run in it (the strategies of one set of
    ranks, `single` for the oracle, the cost model) reads the same ones. Nobody writes to them: batches
    are copies."""
    g = torch.Generator().manual_seed(10_000 + seed)  # independent of the model's init stream
    # (classes, d); the GAN's images come from 10 prototypes whatever its 1 "class"
    protos = workload.classes if workload.data == "teacher" else max(workload.classes, 10)
    teacher = _prototypes(workload.input_shape, protos, g)
    return teacher, *_samples(workload, teacher, n, g)


def _samples(workload, teacher: torch.Tensor, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.randint(0, teacher.shape[0], (n,), generator=g)
    if workload.data == "images":  # y: the generator's input, of the shape its model declares
        noise = torch.randn((n, teacher.shape[1]), generator=g)
        x = torch.sigmoid(4 * SIGNAL * teacher[source] + 0.5 * noise)  # in (0, 1), like the generator's
        return x.reshape(n, *workload.input_shape), torch.randn((n, *workload.make_module.LATENT), generator=g)
    x = SIGNAL * teacher[source] + torch.randn((n, teacher.shape[1]), generator=g)  # (n, d)
    y = (x @ teacher.T).argmax(dim=1)  # the teacher's label, (n,)
    return x.reshape(n, *workload.input_shape), y
