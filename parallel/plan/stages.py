"""Pipeline stages: which layers, and which ends of the model, each pipeline rank holds, and how many
micro-batches of activations it keeps at its peak.

Two partitions (`Training.partition`):

- "even" (Megatron, torch.distributed.pipelining as torchtitan splits it): ceil(L / (pp v)) layers a chunk,
  the embedding on the first rank, the head and the loss on the last. The planner has always counted the
  first and the last rank of it, each with the busiest rank's layers (an upper bound when pp does not divide
  L).
- "cost" (nanotron's build_model, read in its models/base.py): the blocks in order (embedding, the layers,
  the final norm, the head, the fp32 cast, the loss), each with a cost (a layer 4h^2 + 3Fh, the head Vh, the
  rest 0, its get_block_compute_costs), handed to rank r until the running total passes r+1 pp-ths of the
  whole; the block that passes it stays on rank r. The head can so land one rank before the loss, which
  then receives the logits.

1F1B keeps pp - r micro-batches on rank r (r = 0 the first); GPipe all m; interleaved, the first rank
p (1 + (p-1)/(p v)) (Korthikanti 2022, section 4.2.3).
"""

from __future__ import annotations

import dataclasses

from parallel.plan.layouts import Layout, Training
from parallel.plan.models import ModelShape


@dataclasses.dataclass(frozen=True)
class Stage:
    rank: int
    layers: int  # decoder layers on the rank (all its chunks)
    embedding: bool = False
    head: bool = False  # the output projection to the vocabulary
    loss: bool = False  # the fp32 cast of the logits and the cross-entropy
    held: float = 1.0  # micro-batches of activations held at the rank's peak


def in_flight(lay: Layout, m: int) -> float:
    """Micro-batches' worth of layers the first stage holds at its peak: GPipe all m; 1F1B p
    (Narayanan 2021); interleaved, p (1 + (p-1)/(p v)) (Korthikanti 2022, section 4.2.3)."""
    p, v = lay.pp, lay.stages_per_rank
    if p == 1:
        return 1.0
    if lay.schedule == "gpipe":
        return m
    return min(p, m) * (1 + (p - 1) / (p * v) if v > 1 else 1)


def stages(model: ModelShape, lay: Layout, train: Training, m: int) -> list[Stage]:
    """The ranks of one pipeline whose memory or time can be the largest: all of them under the cost
    partition, the first and the last under the even one (one stage when pp is 1)."""
    layers = lay.layers(model.layers)
    if lay.pp == 1:
        return [Stage(0, layers, True, True, True, 1.0)]
    if train.partition == "even" or lay.stages_per_rank > 1:
        last = in_flight(lay, m) if lay.stages_per_rank > 1 or lay.schedule == "gpipe" else 1
        return [Stage(0, layers, embedding=True, held=in_flight(lay, m)),
                Stage(lay.pp - 1, layers, head=True, loss=True, held=last)]
    return by_cost(model, lay, m, lay.schedule == "gpipe")


def by_cost(model: ModelShape, lay: Layout, m: int, gpipe: bool = False) -> list[Stage]:
    """nanotron's greedy split (build_model): contiguous blocks, rank r takes blocks until the running cost
    passes (r + 1) / pp of the total."""
    layer = 4 * model.heads * (model.hidden // model.heads) * model.hidden + 3 * model.F * model.hidden
    blocks = ["embedding"] + ["layer"] * model.layers + ["norm", "head", "cast", "loss"]
    cost = {"layer": layer, "head": model.vocab * model.hidden}
    total = sum(cost.get(b, 0) for b in blocks)
    owner, rank, running = [], 0, 0
    for b in blocks:
        owner.append(rank)
        running += cost.get(b, 0)
        if rank < lay.pp - 1 and running > total * (rank + 1) / lay.pp:
            rank += 1
    return [Stage(r, sum(1 for b, o in zip(blocks, owner, strict=True) if o == r and b == "layer"),
                  embedding=owner[0] == r, head=owner[blocks.index("head")] == r, loss=owner[-1] == r,
                  held=m if gpipe else min(lay.pp - r, m))
            for r in range(lay.pp)]
