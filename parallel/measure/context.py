"""The context family's measurement (context_parallel, fsdp_cp: every sequence split between the ranks of
a group, attention by kit.ring_attention): the K,V bytes beside the ring's formula, the causal (query,
key) pairs each rank computes and its attention time alone (its layout's balance), the activations a
rank saves against one device's on the whole sequence; the report's table and picture of them.

    MEASURE = context.Context(dims, local_loss)                         # context_parallel
    MEASURE = context.Context(dims, context_parallel.local_loss, fsdp_blocks=fsdp.blocks)  # fsdp_cp

It is lent the strategy's layout (`dims`: config -> ParallelDims, cp ranks per group), its loss on a
rank's slice, and for FSDP2 the blocks it shards; it finds the ring itself, in the model's attention."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from rich.table import Table
from torch import nn

from parallel import measure
from parallel.kit.collectives import every_rank
from parallel.kit.ring_attention import Ring, work_alone
from parallel.kit.tensors import param_bytes
from parallel.loop.results import Row
from parallel.measure.formulas import element_bytes
from parallel.measure.sharded_cost import allreduce_every_gradient
from parallel.style import charts, tables
from parallel.style.tables import count, largest, size
from parallel.world.devices import synchronizer
from parallel.world.dist import local


@dataclass
class Result:
    """What a context-parallel run measured (details["context"]); per rank: one entry a rank, in rank order."""

    FAMILY: ClassVar[str] = "context"
    cp: int = 1  # ranks per context-parallel group
    layout: str = ""  # contiguous, zigzag
    comm: str = ""  # ring, allgather
    kv_block_bytes: float = 0.0  # one rank's K,V block, one attention layer
    attention_bytes_predicted: float = 0.0  # K,V around the group per rank and step: 3 (cp-1) blocks a layer
    causal_pairs_per_rank: list = field(default_factory=list)  # (q, k) pairs per head, sequence, attention call
    causal_pairs_formula: list = field(default_factory=list)  # the layout's sum over positions, ranks 0..cp-1
    attention_ms_per_rank: list = field(default_factory=list)  # its attention alone, forward and backward
    activation_bytes_per_rank: list = field(default_factory=list)  # saved for backward, its slice
    attention_activation_bytes_per_rank: list = field(default_factory=list)  # of them, inside attention
    single_activation_bytes_per_rank: list = field(default_factory=list)  # the whole sequence on one device
    single_attention_activation_bytes_per_rank: list = field(default_factory=list)


class Context(measure.Family):
    """Context parallelism measured. `dims`: (config, dist=None) -> the ParallelDims of dp x cp; `loss`:
    (t, batch) -> the mean loss over this rank's slice; `fsdp_blocks`: model -> the blocks FSDP2 shards
    over every rank (fsdp_cp), None where the gradients are all-reduced (context_parallel)."""


    def __init__(self, dims, loss, fsdp_blocks=None):
        self.dims, self.loss, self.fsdp_blocks = dims, loss, fsdp_blocks

    def comm_bytes_predicted(self, model, run) -> float:
        """The K,V ring and the gradients' reduction: one all-reduce of every gradient, or FSDP2's
        collectives of the parameters, each (N-1)/N of their bytes: a reduce-scatter, and an all-gather in
        forward and again in backward, but the root's parameters (those no block holds: the embeddings)
        are gathered once, as FSDP2 keeps the root unsharded between its forward and backward."""
        ring = attention_bytes_predicted(model, run, self.dims(run).cp)
        if self.fsdp_blocks is None:
            return ring + allreduce_every_gradient(model, run)
        n, p = run.world_size, param_bytes(model.parameters())
        in_blocks = param_bytes(q for b in self.fsdp_blocks(model) for q in b.parameters())
        return ring + (n - 1) / n * (2 * in_blocks + (p - in_blocks) + p)

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        """Bytes beside the formula, each rank's causal pairs and attention time, activations per rank."""
        lay, ring = self.dims(run, dist), t.model.attentions()[0].attend  # the kit.Ring every layer calls
        cp, batch = lay.cp, data.batch(0, *lay.batch_share(dist.rank))
        with counting_pairs(ring) as pairs:
            mine, mine_attention = saved_bytes(t.model, lambda: self.loss(t, batch))
        whole, whole_attention = single_saved_bytes(t.model, t.loss_fn, [b.to(t.device) for b in batch])
        out = Result(cp, ring.split.name, ring.comm, kv_bytes(t.model, run, cp),
                     attention_bytes_predicted(t.model, run, cp),
                     causal_pairs_per_rank=every_rank(pairs[0] // len(t.model.attentions())),
                     causal_pairs_formula=[ring.split.causal_pairs(r) for r in range(cp)],
                     attention_ms_per_rank=every_rank(round(attention_ms(t.model, ring, len(batch[0]), t.device), 3)),
                     activation_bytes_per_rank=every_rank(mine),
                     attention_activation_bytes_per_rank=every_rank(mine_attention),
                     single_activation_bytes_per_rank=every_rank(whole),
                     single_attention_activation_bytes_per_rank=every_rank(whole_attention))
        return {"bytes_per_step_by_collective": result.wire.per_step(), Result.FAMILY: out}


# What is predicted -------------------------------------------------------------------------------------


def kv_bytes(model: nn.Module, run, cp: int) -> float:
    """The bytes of one rank's K,V block, one attention layer: 2 x (B/dp) x (T/cp) x width x 4 (2 under
    --precision bf16: the projections' outputs are bf16 there; 8 under fp64)."""
    width, element = model.attentions()[0].q.out_features, 2 if run.precision == "bf16" else element_bytes(
        run.precision)
    rows, positions = run.batch_size // (run.world_size // cp), run.workload.input_shape[0] // cp
    return 2 * rows * positions * width * element


def attention_bytes_predicted(model: nn.Module, run, cp: int) -> float:
    """K,V around the group, per rank and step: 3 (cp-1) blocks per attention layer, forward and backward
    (kit/ring_attention.py's module docstring), for either comm."""
    return 3 * (cp - 1) * kv_bytes(model, run, cp) * len(model.attentions())


# What is measured --------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting_pairs(ring: Ring):
    """Yields [pairs]: the (query, key) pairs per head and sequence of every product the ring hands its
    kernels inside the block, counted by wrapping its `blocks` on the instance (its own again after)."""
    total, blocks = [0], ring.blocks

    def counted(src):
        out = blocks(src)
        total[0] += sum((qi.stop - qi.start) * (ki.stop - ki.start) - (0 if m is None else int(m.sum()))
                        for qi, ki, m, _ in out)
        return out

    ring.blocks = counted
    try:
        yield total
    finally:
        del ring.blocks  # the class's method again


@contextlib.contextmanager
def attending(model: nn.Module, wrap):
    """Every attention of `model` calls wrap(its attend) inside the block, its own attend again after."""
    attentions = model.attentions()
    attends = [a.attend for a in attentions]
    for a, attend in zip(attentions, attends, strict=True):
        a.attend = wrap(attend)
    try:
        yield
    finally:
        for a, attend in zip(attentions, attends, strict=True):
            a.attend = attend


def saved_bytes(model: nn.Module, result) -> tuple[int, int]:
    """(bytes of every tensor autograd saves for backward in run(), those saved inside attention),
    parameters left out (they are state, not activations), each storage counted once."""
    seen, totals, inside = set(), [0, 0], [False]

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        params = {local(p).untyped_storage().data_ptr() for p in model.parameters()}  # FSDP2's gathered ones too
        if ptr not in params and ptr not in seen:
            seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
            totals[0] += nbytes
            totals[1] += nbytes if inside[0] else 0
        return t

    def flagged(attend):
        def call(q, k, v):
            inside[0] = True
            try:
                return attend(q, k, v)
            finally:
                inside[0] = False
        return call

    with attending(model, flagged), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result()
    return totals[0], totals[1]


def single_saved_bytes(model: nn.Module, loss_fn, batch) -> tuple[int, int]:
    """saved_bytes of the whole sequence on one device: the same model, torch's attention, this process."""
    from parallel.models.transformer import causal

    x, y = batch
    with attending(model, lambda _: causal):
        return saved_bytes(model, lambda: loss_fn(model(x), y))


def attention_ms(model: nn.Module, ring: Ring, batch_rows: int, device, rounds: int = 5) -> float:
    """Median ms of this rank's attention work, forward and backward, every block of the group held
    locally (no communication): the causal work its layout gives it."""
    a = model.attentions()[0]
    heads, d, length = a.q.out_features // a.head_size, a.head_size, len(ring.split.positions(ring.rank))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_rows, heads, length, d, generator=g).to(device) for _ in range(3))
    sync, times = synchronizer(device), []
    for i in range(rounds + 1):
        sync()
        start = time.perf_counter()
        work_alone(ring, q, k, v)
        sync()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


# What is shown -----------------------------------------------------------------------------------------


def rows_of(rows: list[Row]) -> list[tuple[Row, Result]]:
    return [(r, res) for r in rows if (res := measure.result_of(r, Result)) is not None]


def by_rank(values, show) -> str:
    """Each rank's value, shown, one after another."""
    return " ".join(show(v) for v in values or [] if v is not None) or "-"


def ms(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def sent(r: Row) -> str:
    """Bytes a rank sent per step, and the prediction in brackets."""
    return f"{size(r.comm_bytes_per_step, short=True)} ({size(r.comm_bytes_predicted, short=True)})"


def table(rows: list[Row]) -> Table | None:
    """Every context-parallel row: bytes per step beside the formula, each rank's causal (q, k) pairs and
    attention time (its layout's balance), and the activations a rank saves against 1/cp of one device's."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    t = tables.table("Context parallel: bytes against the formula; each rank's causal pairs, attention time, "
                     "activations", [("strategy", "left"), ("layout", "left"), ("cp", "right"),
                                     ("sent (formula)", "right"), ("causal pairs", "left"), ("attention ms", "left"),
                                     ("activations (1/cp of one)", "right")])
    t.columns[0].no_wrap = True  # a strategy's name whole
    for r, res in chosen:
        single = largest(res.single_activation_bytes_per_rank)
        mine = size(largest(res.activation_bytes_per_rank), short=True)
        t.add_row(r.strategy, f"{res.layout or '-'} {res.comm}", str(res.cp), sent(r),
                  by_rank(res.causal_pairs_per_rank[:res.cp], count), by_rank(res.attention_ms_per_rank[:res.cp], ms),
                  f"{mine} ({size(single / res.cp, short=True)})" if single else mine)
    return t


def per_rank_figure(labels: list[str], times: list, left_label: str, right_label: str):
    """Two panels sharing one row per rank: the caller draws bars on the left (returned), and the time on
    the right as dots."""
    fig, (left, right) = charts.plt().subplots(1, 2, figsize=(9, charts.height(len(labels))), sharey=True)
    left.set_xlabel(left_label)
    right.plot([v or 0 for v in times], range(len(labels)), "o", color="#dd8452")
    right.set_xlabel(right_label)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    return fig, left


def picture(rows: list[Row]) -> str | None:
    """Each context-parallel row's ranks: the causal (q, k) pairs its layout gives them (bars, left) and
    the attention time measured on them (dots, right)."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    bars = [(f"{r.label} rank {k}", pairs, t) for r, res in chosen for k, (pairs, t) in enumerate(zip(
        res.causal_pairs_per_rank[:res.cp], res.attention_ms_per_rank + [None] * res.cp, strict=False))]
    fig, left = per_rank_figure([b[0] for b in bars], [b[2] for b in bars], "causal (q, k) pairs per head and sequence",
                                "attention ms (forward + backward, no communication)")
    left.barh(range(len(bars)), [b[1] for b in bars], color="#4c72b0")
    return charts.svg(fig)
