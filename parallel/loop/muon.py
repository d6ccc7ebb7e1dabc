"""--optimizer muon (docs/optimizer.md): torch.optim.Muon on the hidden 2-D matrices (the kind "matrix",
loop/optim.py), torch.optim.AdamW on the rest (embeddings, the head, norms, biases, convolutions), as
Muon's authors run it. One optimiser, so that the clip, the schedule and the checkpoints see one:

    B <- lerp(B, G, 1 - mu)                  momentum, mu 0.95, Nesterov (torch's defaults): elementwise
    U <- lerp(G, B, mu)
    O <- NS5(bf16(U))                        Newton-Schulz, 5 iterations, in bf16: it needs the WHOLE matrix
    W <- W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O    A x B the matrix (Moonshot's "match_rms_adamw"
                                                     scaling, so that one --lr and --weight-decay serve both)

A layout that holds each matrix whole (data parallel, pipelines, experts, context parallelism, torch's
ZeroRedundancyOptimizer, whose ranks each own whole parameters) steps torch.optim.Muon itself. A layout
that shards a matrix cannot: Newton-Schulz of a shard is not a shard of Newton-Schulz (the injected bug
fsdp:muon-shard-alone). Here each shard's bf16 U is all-gathered, the whole matrix is orthogonalised with
torch's own Newton-Schulz (the bits `single` computes from the same U) and the rank keeps its part:

    bytes a step per rank   2 (N - 1)/N x the sharded matrices' elements (bf16), N the ranks of a shard
    work                    Newton-Schulz of every sharded matrix on each of its N ranks (ZeRO's chunks:
                            only of the matrices a rank's chunk touches)

Where a matrix is sharded, and how it is gathered:

    a DTensor (FSDP2, tensor_parallel, the compositions)   redistributed to Replicate; its part taken back
                                                             by the reverse, a local slice
    a hand-cut shard (manual_tp)         `split(p, dim)`: all-gathered along dim over the world
    a chunk of a flat bucket (zero)      `Chunk`: the bucket all-gathered, each matrix in the chunk's reach
                                         orthogonalised, the chunk's pieces kept

torch.optim.Muon handed FSDP2's DTensors runs (DTensor distributes each matmul) but sums its partial
products in bf16: measured 2-3e-3 off one device's step on an 8 x 6 matrix over 2 ranks, the size of the
step's own rounding; the gather here gives the same bits as one device.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as td

from parallel.world.dist import is_dtensor

# torch.distributed.tensor is imported where a DTensor is met: config.py imports this module (dist.is_dtensor).

try:  # torch's own Newton-Schulz and lr scaling: private, so an older torch may not have them
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr
    from torch.optim._muon import _zeropower_via_newtonschulz as newton_schulz
except ImportError as missing:  # --optimizer muon is refused in one line (config.check_recipe)
    MISSING = (f"--optimizer muon needs torch.optim.Muon's Newton-Schulz, which torch {torch.__version__} "
               f"lacks ({missing})")
    DEFAULT_A = DEFAULT_B = DEFAULT_C = DEFAULT_NS_STEPS = EPS = None
else:
    MISSING = ""


WHOLE = "_parallel_whole"  # the attribute a hand-cut shard carries its gather in
ADJUST = "match_rms_adamw"
SETTINGS = {"momentum": 0.95, "nesterov": True, "ns_coefficients": (DEFAULT_A, DEFAULT_B, DEFAULT_C),
            "eps": EPS, "ns_steps": DEFAULT_NS_STEPS, "adjust_lr_fn": ADJUST}


class MuonAdamW(torch.optim.Optimizer):
    """Groups marked {"muon": True} step by Muon, the others by torch.optim.AdamW; `alone` is the injected
    bug's switch (each shard orthogonalised by itself)."""

    def __init__(self, params, lr: float, weight_decay: float, betas=(0.9, 0.95)):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        for group in self.param_groups:
            for k, v in (SETTINGS if group.get("muon") else {"betas": betas}).items():
                group.setdefault(k, v)
        rest = [g for g in self.param_groups if not g.get("muon")]
        self._adamw = torch.optim.AdamW(rest, lr=lr, betas=betas) if rest else None  # fills its groups' keys
        self._muon: torch.optim.Muon | None = None
        self.alone = False
        # fsdp_tp's (_StridedShard, Shard) to Replicate is two all-gathers, which torch logs as a warning every
        # step, on every rank; nothing is reduced, so no order can differ: the gather is quieted, once
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)

    @torch.no_grad()
    def step(self, closure=None):
        muon = [g for g in self.param_groups if g.get("muon")]
        if self._adamw is not None:  # the groups and state are this optimiser's (a load replaces them)
            self._adamw.param_groups = [g for g in self.param_groups if not g.get("muon")]
            self._adamw.state = self.state
            self._adamw.step()
        whole = [{**g, "params": [p for p in g["params"] if p.grad is not None and gather_of(p) is None]}
                 for g in muon]
        if any(g["params"] for g in whole):
            if self._muon is None:
                self._muon = torch.optim.Muon([p for g in whole for p in g["params"]], **SETTINGS)
            self._muon.param_groups, self._muon.state = whole, self.state  # torch's own step
            self._muon.step()
        for group in muon:
            for p in group["params"]:
                if p.grad is not None and (gather := gather_of(p)) is not None:
                    _sharded_step(p, self.state[p], group, _alone if self.alone else gather)


def _sharded_step(p, state: dict, group: dict, gather) -> None:
    """torch.optim.Muon's step on a shard, the orthogonalisation of the whole matrix between (`gather`)."""
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = torch.zeros_like(p.grad)
    buf, mu = state["momentum_buffer"], group["momentum"]
    buf.lerp_(p.grad, 1 - mu)
    update = p.grad.lerp(buf, mu) if group["nesterov"] else buf
    lr = group["lr"]

    def orthogonalise(whole: torch.Tensor) -> torch.Tensor:
        return newton_schulz(whole, group["ns_coefficients"], group["ns_steps"], group["eps"])

    pieces = gather(p, update.bfloat16(), orthogonalise)
    p.mul_(1 - lr * group["weight_decay"])
    for where, piece, shape in pieces:
        (p if where is None else p[where]).add_(piece, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))


def gather_of(p: torch.Tensor):
    """How p's whole matrix is gathered: None where p is whole (torch's Muon steps it)."""
    if (gather := getattr(p, WHOLE, None)) is not None:
        return gather
    if is_dtensor(p):
        return _dtensor
    if p.ndim != 2:
        raise RuntimeError(f"internal: a parameter of shape {tuple(p.shape)} reached Muon without its matrix")
    return None


def _dtensor(p, update, orthogonalise):
    from torch.distributed.tensor import DTensor, Replicate

    mesh, every = update.device_mesh, [Replicate()] * update.device_mesh.ndim
    whole = orthogonalise(update.redistribute(mesh, every).to_local())  # the all-gather
    return [(None, DTensor.from_local(whole, mesh, every, run_check=False).redistribute(mesh, update.placements),
             whole.shape)]  # Replicate to a shard: a slice, no message


def _alone(p, update, orthogonalise):
    """The injected bug (fsdp:muon-shard-alone): the DTensor's own shard orthogonalised, as if it were the matrix."""
    from torch.distributed.tensor import DTensor

    piece = orthogonalise(update.to_local())
    return [(None, DTensor.from_local(piece, update.device_mesh, update.placements, run_check=False), p.shape)]


def split(p: torch.nn.Parameter, dim: int) -> torch.nn.Parameter:
    """Mark p as this rank's equal part, along `dim`, of a matrix cut over every rank (manual_tp)."""
    setattr(p, WHOLE, _Split(dim))
    return p


class _Split:
    def __init__(self, dim: int):
        self.dim = dim

    def __call__(self, p, update, orthogonalise):
        n, rank = td.get_world_size(), td.get_rank()
        parts = [torch.empty_like(update) for _ in range(n)]
        td.all_gather(parts, update.contiguous())
        whole = orthogonalise(torch.cat(parts, dim=self.dim))
        return [(None, whole.chunk(n, dim=self.dim)[rank], whole.shape)]


class Chunk:
    """A rank's chunk [start, start + length) of a flat bucket of matrices, each (offset, shape) in it."""

    def __init__(self, matrices: list[tuple[int, torch.Size]], start: int, length: int, world: int):
        self.matrices, self.start, self.length, self.world = matrices, start, length, world

    def __call__(self, p, update, orthogonalise):
        parts = [torch.empty_like(update) for _ in range(self.world)]
        td.all_gather(parts, update.contiguous())
        bucket = torch.cat(parts)
        pieces, lo, hi = [], self.start, self.start + self.length
        for offset, shape in self.matrices:
            end = offset + math.prod(shape)
            if end <= lo or offset >= hi:  # a matrix this chunk does not touch: not this rank's work
                continue
            whole = orthogonalise(bucket[offset:end].view(shape)).reshape(-1)
            a, b = max(offset, lo), min(end, hi)
            pieces.append((slice(a - lo, b - lo), whole[a - offset:b - offset], shape))
        return pieces


def gathers(optimizer) -> list[tuple[int, int]]:
    """The all-gathers Muon adds to a step: (bytes of the gathered bf16 tensor, ranks) for each sharded
    matrix (a chunk's: its bucket); none for an optimiser that is not this one. The worker prices them
    (formulas.wire_bytes: each rank sends (N - 1)/N of it)."""
    out = []
    for p in (p for g in getattr(optimizer, "param_groups", ()) if g.get("muon") for p in g["params"]):
        gather = gather_of(p)
        if gather is _dtensor:
            out.append((2 * p.numel(), math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements)
                                                 if pl.is_shard())))
        elif isinstance(gather, _Split):
            out.append((2 * p.numel() * td.get_world_size(), td.get_world_size()))
        elif isinstance(gather, Chunk):
            out.append((2 * gather.length * gather.world, gather.world))
    return out
