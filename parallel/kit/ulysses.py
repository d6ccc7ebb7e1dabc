"""Causal attention over a sequence split between the ranks of a group, by all-to-all: DeepSpeed-Ulysses
(Jacobs et al. 2023), by hand, and with a ring inside it (USP, Fang and Zhao 2024; Megatron's a2a+p2p).

Rank r of U holds L = s / U consecutive positions of every sequence, with every head. Attention needs
every position but treats each head alone, so two all-to-alls turn a split of the sequence into a split
of the heads and back:

    q, k, v (B, H, L, d) --all-to-all--> (B, H/U, s, d)    rank r: heads r H/U .. (r+1) H/U - 1, every position
    ordinary causal attention on them                       no mask arithmetic, no log-sum-exp merge
    out (B, H/U, s, d) --all-to-all--> (B, H, L, d)         its own positions back, every head

    U = 2, H = 4:   rank 0 holds positions 0-7 of heads 0-3   ->  heads 0-1 of positions 0-15
                    rank 1 holds positions 8-15 of heads 0-3  ->  heads 2-3 of positions 0-15

The backward of an all-to-all is the reverse all-to-all (collectives.all_to_all), so autograd carries
every gradient home. Per rank and attention layer each all-to-all sends (U-1)/U of what it is given: q,
k, v and out forward, their gradients backward, at L positions. Its degree is bounded by the heads: U
must divide H, and the kv heads K of grouped-query attention must divide by U or divide U; where K < U
each kv head is sent U/K times (`copies`), so that every rank receives the one its query heads read
(tensor parallelism copies the weights instead: kv_copies.py). The bound is what the ring lifts:

    hybrid (--ring R)  N = U x R ranks: the all-to-all over U neighbours, and inside it ring attention
                       (ring_attention.py) over the R groups, each holding s / R positions (a Split of the
                       sequence over R) with H / U heads: U heads' worth of bytes leave the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as td

from parallel.kit.collectives import all_to_all
from parallel.kit.ring_attention import Ring, Split
from parallel.models.transformer import causal


@dataclass
class Ulysses:
    """What one rank's attention needs: the group of its all-to-all (U ranks), and the ring of R groups
    inside it (None: R = 1). `heads_back`, the last step, is one an injected bug may replace."""

    group: object
    ring: Ring | None = None
    grouped: bool = True  # takes k, v with the model's kv heads (transformer.Attention repeats them for others)

    def __post_init__(self):
        self.size = td.get_world_size(self.group)

    def __call__(self, q, k, v):  # (B, H, L, d), (B, K, L, d) x 2: this rank's positions -> (B, H, L, d)
        k, v = copies(k, self.size), copies(v, self.size)
        q, k, v = (self.to_heads(x) for x in (q, k, v))  # (B, H/U, s/R, d): every position of the group
        if (group := q.shape[1] // k.shape[1]) > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return self.to_sequence(self.attention(q, k, v))

    def attention(self, q, k, v):
        """Causal attention over the group's positions: ordinary, or the ring's across the R groups."""
        return causal(q, k, v) if self.ring is None else self.ring(q, k, v)

    def to_heads(self, x):
        """(B, n, L, d), n heads at this rank's positions -> (B, n/U, U L, d): n/U heads at the group's."""
        b, n, length, d = x.shape
        chunks = x.reshape(b, self.size, n // self.size, length, d).transpose(0, 1)  # chunk r: rank r's heads
        got = all_to_all(chunks.contiguous(), self.group)  # chunk r: rank r's positions
        return got.permute(1, 2, 0, 3, 4).reshape(b, n // self.size, self.size * length, d)

    def to_sequence(self, y):
        """(B, h, U L, d), h heads at the group's positions -> (B, U h, L, d): every head at this rank's."""
        b, h, s, d = y.shape
        chunks = y.reshape(b, h, self.size, s // self.size, d).permute(2, 0, 1, 3, 4)  # chunk r: r's positions
        return self.heads_back(all_to_all(chunks.contiguous(), self.group))  # chunk r: rank r's heads

    @staticmethod
    def heads_back(got):
        """(U, B, h, L, d), rank r's heads in chunk r -> (B, U h, L, d): rank r's heads at r h .. (r+1) h - 1."""
        u, b, h, length, d = got.shape
        return got.transpose(0, 1).reshape(b, u * h, length, d)


def copies(kv: torch.Tensor, size: int) -> torch.Tensor:
    """k or v (B, K, L, d) as the all-to-all must send it: as it is where U divides K; each kv head
    repeated U/K times where K < U, so that rank r receives kv head r K / U, the one its queries read."""
    kv_heads = kv.shape[1]
    return kv if kv_heads % size == 0 else kv.repeat_interleave(size // kv_heads, dim=1)


def heads_problem(heads: int, kv_heads: int, size: int) -> str | None:
    """Why an all-to-all over `size` ranks cannot split these heads, or None."""
    if heads % size:
        return f"the all-to-all over {size} ranks splits the heads, and {heads} do not divide by {size}"
    if kv_heads % size and size % kv_heads:
        return f"{kv_heads} kv heads neither divide by the {size} ranks of the all-to-all nor divide them"
    return None


def kv_heads_sent(kv_heads: int, size: int) -> int:
    """The kv heads each all-to-all of k or v carries: K, or U where each of K < U is copied U/K times."""
    return kv_heads if kv_heads % size == 0 else size


def placed(world: int, cp: int, ring: int, layout: str, seq: int, rank: int, timeout,
           comm: str = "ring") -> tuple[Ulysses, torch.Tensor]:
    """This rank's Ulysses, where each run of `cp` ranks splits a sequence of `seq` positions with a ring of
    `ring` inside (its Split by `layout`; contiguous where there is no ring), and the positions it holds:
    rank `rank` of its group holds part rank % U of what ring rank rank // U holds. A collective (subgroups)."""
    a2a, ring_group = subgroups(world, cp, ring, timeout)
    split = Split(layout if ring > 1 else "contiguous", ring, seq)  # what each ring rank holds
    where, part = divmod(rank, cp // ring)
    attend = Ulysses(a2a, Ring(ring_group, split, comm) if ring_group is not None else None)
    return attend, split.positions(where).chunk(cp // ring)[part]


def subgroups(world: int, cp: int, ring: int, timeout) -> tuple[object, object | None]:
    """(this rank's all-to-all group, its ring group or None) where each run of `cp` ranks splits a
    sequence, as U = cp / ring neighbours (the all-to-all: on GPUs a node's fast links) times `ring` of
    them (rank c of a cp group: ring position c // U, all-to-all position c % U). Every rank makes every
    group (a collective)."""
    u = cp // ring
    a2a = [[b + j * u + i for i in range(u)] for b in range(0, world, cp) for j in range(ring)]
    rings = [[b + j * u + i for j in range(ring)] for b in range(0, world, cp) for i in range(u)]
    mine = td.new_subgroups_by_enumeration(a2a, timeout=timeout)[0]
    return mine, td.new_subgroups_by_enumeration(rings, timeout=timeout)[0] if ring > 1 else None
