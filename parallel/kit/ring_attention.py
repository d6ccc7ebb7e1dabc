"""Causal attention over a sequence split between the ranks of a group: ring attention by hand.

Rank r of W holds the queries, keys and values of some positions of every sequence (a `Split`):

    contiguous   rank r: positions [r c, (r+1) c), c = T / W           T = 16, W = 2:  r0 0-7     r1 8-15
    zigzag       rank r: chunks r and 2W-1-r of h = T / 2W (head-tail)                 r0 0-3,12-15  r1 4-11

Each rank attends its queries to every rank's K,V block, one block at a time, and merges the partial
results with the online softmax: a block gives out_j = softmax(s_j) v_j and lse_j = logsumexp(s_j) per
query, and two partials combine as

    lse = logaddexp(lse_a, lse_b)      out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse)

Which blocks it sees, and how, depends on `comm`:

    ring       W-1 hops: send the block held to rank r+1, receive the next from r-1, compute on the block
               held meanwhile. Backward passes K,V around again, with an accumulator of dK,dV beside
               them that ends at the block's owner: 2 (W-1) hops. Per rank and attention layer:
               3 (W-1) x its K,V block bytes (forward W-1, backward 2 (W-1)).
    allgather  all-gather K,V (forward, and again in backward rather than keeping them all), then
               reduce-scatter dK,dV: 3 (W-1) x the same bytes, in three collectives.

The backward is written out (`_Ring`, a torch.autograd.Function): autograd cannot carry dK,dV back
across an isend, and a rotation it does not see leaves every rank with the gradient of its K,V from its
own queries only (the bug `context_parallel:rotation-not-differentiable`). Causal masking is by global
positions, so a pair of spans is skipped (every key after every query), computed whole (every key
before) or masked; zigzag balances what is computed exactly, contiguous gives the last rank the most.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as td

from parallel.kit import collectives

SPLITS = ("contiguous", "zigzag")
COMMS = ("ring", "allgather")


@dataclass(frozen=True)
class Split:
    """Which positions of a sequence of `length` each of `world` ranks holds."""

    name: str
    world: int
    length: int

    @property
    def chunks(self) -> int:
        return self.world * (2 if self.name == "zigzag" else 1)

    def spans(self, rank: int) -> list[tuple[int, int]]:
        """(first position, count) of each run of consecutive positions rank `rank` holds, in order."""
        size = self.length // self.chunks
        held = [rank] if self.name == "contiguous" else [rank, self.chunks - 1 - rank]
        return [(c * size, size) for c in held]

    def positions(self, rank: int) -> torch.Tensor:
        """The global positions of rank `rank`'s tokens, in the order it holds them: also its index into
        a whole sequence."""
        return torch.cat([torch.arange(s, s + n) for s, n in self.spans(rank)])

    def causal_pairs(self, rank: int) -> int:
        """(query, key) pairs of one head that rank `rank` computes: each query at position p sees p + 1 keys."""
        return sum(n * s + n * (n + 1) // 2 for s, n in self.spans(rank))


def split_check(layout: str, world: int, length: int) -> str | None:
    """Why a sequence of `length` cannot be split by `layout` over `world` ranks, or None."""
    chunks = Split(layout, world, length).chunks
    if length % chunks:
        return f"--seq-len {length} is not divisible by {chunks} ({layout} over {world} ranks: {chunks} chunks)"
    return None


@dataclass
class Ring:
    """What one rank's attention needs: its group and the split (shared by its layers). Its small steps,
    `mask`, `merge` and `home`, are methods an injected bug may replace on the instance."""

    group: object  # the process group of the cp ranks (None: the default group)
    split: Split  # the positions attention masks by (a bug may give it other ones than the tokens')
    comm: str = "ring"
    fused: bool = True  # torch's fused CPU kernel where it applies (False: the math everywhere, as on GPUs)
    ranks: list[int] = field(default_factory=list)

    def __post_init__(self):
        self.ranks = td.get_process_group_ranks(self.group) if self.group is not None else \
            list(range(td.get_world_size()))
        self.rank = self.ranks.index(td.get_rank())

    def __call__(self, q, k, v):  # (B, H, L, D) each, this rank's positions -> (B, H, L, D)
        return _Ring.apply(q, k, v, self)

    @staticmethod
    def mask(qi: slice, qs: range, ki: slice, ks: range) -> torch.Tensor | None:
        """The causal mask of local query slice qi (global positions qs) against key slice ki (positions ks),
        True where masked: by global position; None where every key comes before every query."""
        if ks.stop <= qs.start + 1:
            return None
        return torch.arange(ks.start, ks.stop)[None, :] > torch.arange(qs.start, qs.stop)[:, None]

    @staticmethod
    def merge(out, lse, out_b, lse_b):
        """Two partial softmax results over disjoint keys, as one (the online softmax)."""
        new = torch.logaddexp(lse, lse_b)
        return out * torch.exp(lse - new).unsqueeze(-1) + out_b * torch.exp(lse_b - new).unsqueeze(-1), new

    def home(self, carried: torch.Tensor) -> torch.Tensor:
        """The last hop of a block's dK,dV (summed over the ranks it visited) home to its owner; what arrives."""
        works, got = _exchange(self, carried)
        _wait(works)
        return got

    def blocks(self, src: int) -> list[tuple[slice, slice, torch.Tensor | None, bool]]:
        """(query slice, key slice, mask or None, diagonal) for every product this rank's queries need with
        rank `src`'s keys: a pair of spans with no visible key is skipped, one cut by the causal line gets
        a mask (`diagonal` where it is the square of the same positions, a kernel's is_causal), and
        neighbouring whole pairs are joined into one product (zig-zag's off-diagonal blocks: both query
        chunks see one key chunk, or one query chunk sees both key chunks)."""
        out = []
        for qi, qs, ki, ks in _span_pairs(self.split.spans(self.rank), self.split.spans(src)):
            if ks.start >= qs.stop:  # every key after every query
                continue
            mask = self.mask(qi, qs, ki, ks)
            if out and mask is None and out[-1][2] is None:
                last_q, last_k = out[-1][:2]
                if last_q == qi and last_k.stop == ki.start:
                    out[-1] = (qi, slice(last_k.start, ki.stop), None, False)
                    continue
                if last_k == ki and last_q.stop == qi.start:
                    out[-1] = (slice(last_q.start, qi.stop), ki, None, False)
                    continue
            out.append((qi, ki, mask, mask is not None and qs == ks))
        return out


def _span_pairs(q_spans, k_spans):
    """(local query slice, global query positions, local key slice, global key positions) for every pair."""
    q_at = 0
    for q_start, qn in q_spans:
        k_at = 0
        for k_start, kn in k_spans:
            yield (slice(q_at, q_at + qn), range(q_start, q_start + qn), slice(k_at, k_at + kn),
                   range(k_start, k_start + kn))
            k_at += kn
        q_at += qn


def _nothing_yet(q):
    """(out, lse) before any block: zeros, and -inf (float32 at least: a bf16 log-sum-exp would lose the
    merge)."""
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.promote_types(q.dtype, torch.float32), device=q.device)
    return torch.zeros_like(q), lse


def work_alone(ring: Ring, q, k, v) -> None:
    """This rank's attention work, forward and backward, with every rank's K,V block taken to be (k, v),
    held here: what its layout asks of it, without communication (for timing it)."""
    out, lse = _nothing_yet(q)
    for src in range(len(ring.ranks)):
        _forward_block(ring, q, k, v, src, out, lse)
    delta, dq = (out * out).sum(-1), torch.zeros_like(q)
    for src in range(len(ring.ranks)):
        _backward_block(ring, q, k, v, src, out, out, lse, delta, dq)


def _forward_block(ring, q, k, v, src, out, lse):
    """Merge this rank's attention to rank `src`'s K,V block into (out, lse)."""
    for qi, ki, mask, diagonal in ring.blocks(src):
        part, part_lse = _attend(q[:, :, qi], k[:, :, ki], v[:, :, ki], mask, diagonal, ring.fused)
        out[:, :, qi], lse[:, :, qi] = ring.merge(out[:, :, qi], lse[:, :, qi], part, part_lse.to(lse.dtype))


def _backward_block(ring, q, k, v, src, do, out, lse, delta, dq):
    """Add this block's share of dq; return its dK, dV (for the block's owner). With the final out and
    lse, each product's gradients are its share of the whole softmax's."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for qi, ki, mask, diagonal in ring.blocks(src):
        grads = _attend_backward(do[:, :, qi], q[:, :, qi], k[:, :, ki], v[:, :, ki], out[:, :, qi], lse[:, :, qi],
                                 delta[:, :, qi], mask, diagonal, ring.fused)
        dq[:, :, qi] += grads[0]
        dk[:, :, ki] += grads[1]
        dv[:, :, ki] += grads[2]
    return dk, dv


def _fused(q, mask, diagonal) -> bool:
    """Whether torch's fused attention kernel for CPU (flash: no score matrix kept, the lse returned) computes
    this product: on CPU, whole or the causal square (`diagonal`: False where it must not). Elsewhere the
    math below does (on GPUs torch's kernels differ by dtype and release; the math runs everywhere).
    Measured on this 2-core CPU, context_parallel zig-zag on 2 ranks, T = 2048, batch 2: the math's score
    matrices made a step 0.72x of one device's (whose SDPA is this kernel)."""
    return q.device.type == "cpu" and (mask is None or diagonal)


def _attend(q, k, v, mask, diagonal, fused=True):
    """(out, lse) of q's attention to these keys alone."""
    if fused and _fused(q, mask, diagonal):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, diagonal)
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if mask is not None:
        s = s.masked_fill(mask.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return torch.exp(s - lse.unsqueeze(-1)) @ v, lse


def _attend_backward(do, q, k, v, out, lse, delta, mask, diagonal, fused=True):
    """(dq, dk, dv) of one product, given the final out and lse of the queries (softmax over all keys)."""
    if fused and _fused(q, mask, diagonal):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, out, lse, 0.0, diagonal)
    scale = 1 / math.sqrt(q.shape[-1])
    s = q @ k.transpose(-2, -1) * scale
    if mask is not None:
        s = s.masked_fill(mask.to(s.device), float("-inf"))
    p = torch.exp(s - lse.unsqueeze(-1))
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ do


def _exchange(ring: Ring, send: torch.Tensor):
    """Start sending `send` to the next rank of the ring and receiving the previous rank's into a new
    tensor; returns (works, received)."""
    w = len(ring.ranks)
    got = torch.empty_like(send)
    ops = [td.P2POp(td.isend, send, ring.ranks[(ring.rank + 1) % w], ring.group),
           td.P2POp(td.irecv, got, ring.ranks[(ring.rank - 1) % w], ring.group)]
    return td.batch_isend_irecv(ops), got


def _wait(works) -> None:
    for work in works:
        work.wait()


def _gathered(ring: Ring, kv: torch.Tensor) -> torch.Tensor:
    """Every rank's [K; V] block, (W, 2, B, H, L, D), by an all-gather."""
    out = kv.new_empty((len(ring.ranks), *kv.shape))
    collectives.all_gather(out.view(-1), kv.contiguous().view(-1), group=ring.group)
    return out


class _Ring(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: Ring):
        w, me = len(ring.ranks), ring.rank
        out, lse = _nothing_yet(q)
        kv = torch.stack([k, v])
        if ring.comm == "allgather":
            for src, block in enumerate(_gathered(ring, kv)):
                _forward_block(ring, q, block[0], block[1], src, out, lse)
        else:
            for hop in range(w):
                pending = _exchange(ring, kv) if hop < w - 1 else None  # the next block moves meanwhile
                _forward_block(ring, q, kv[0], kv[1], (me - hop) % w, out, lse)
                if pending:
                    _wait(pending[0])
                    kv = pending[1]
        ctx.ring = ring
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        ring = ctx.ring
        q, k, v, out, lse = ctx.saved_tensors
        w, me = len(ring.ranks), ring.rank
        do = do.contiguous()
        delta = (do * out).sum(-1)  # rowsum(dO o O): the softmax's backward, per query
        dq = torch.zeros_like(q)
        kv = torch.stack([k, v])
        if ring.comm == "allgather":
            blocks = _gathered(ring, kv)
            grads = torch.stack([torch.stack(_backward_block(ring, q, b[0], b[1], src, do, out, lse, delta, dq))
                                 for src, b in enumerate(blocks)])  # (W, 2, ...): every owner's dK, dV
            dkv = torch.empty_like(kv)
            collectives.reduce_scatter(dkv.view(-1), grads.view(-1), group=ring.group)
            return dq, dkv[0], dkv[1], None
        own = torch.stack(_backward_block(ring, q, k, v, me, do, out, lse, delta, dq))
        carried = None  # the dK,dV of the block held, summed over the ranks it has visited
        for hop in range(1, w):
            works, got = _exchange(ring, kv if carried is None else torch.cat([kv, carried]))
            _wait(works)
            kv, arrived = got[:2], (got[2:] if carried is not None else None)
            mine = torch.stack(_backward_block(ring, q, kv[0], kv[1], (me - hop) % w, do, out, lse, delta, dq))
            carried = mine if arrived is None else arrived + mine
        if carried is not None:  # one more hop: home to the block's owner
            own = own + ring.home(carried)
        return dq, own[0], own[1], None
