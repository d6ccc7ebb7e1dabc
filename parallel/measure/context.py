"""The context family's measurement (context_parallel, fsdp_cp, ulysses, fsdp_ulysses: every sequence split
between the ranks of a group, attention by kit.ring_attention or kit.ulysses): the attention's bytes beside
its formula, the causal (query, key) pairs each rank computes and its attention time alone (its layout's
balance), the activations a rank saves against one device's on the whole sequence; the report's table
and picture of them.

    MEASURE = context.Context(dims, local_loss)                         # context_parallel
    MEASURE = context.Context(dims, context_parallel.local_loss, fsdp_blocks=fsdp.blocks)  # fsdp_cp
    MEASURE = context.Context(dims, local_loss, attention_bytes=context.a2a_bytes_predicted)  # ulysses

It is lent the strategy's layout (`dims`: config -> ParallelDims, cp ranks per group), its loss on a
rank's slice, for FSDP2 the blocks it shards, and the formula of its attention's bytes (the ring's by
default); it finds the ring or the all-to-all itself, in the model's attention."""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from parallel import measure
from parallel.kit.collectives import every_rank
from parallel.kit.ring_attention import Ring, work_alone
from parallel.kit.tensors import param_bytes
from parallel.kit.ulysses import heads_problem, kv_heads_sent
from parallel.measure.formulas import element_bytes
from parallel.measure.sharded_cost import allreduce_every_gradient
from parallel.world.devices import synchronizer
from parallel.world.dist import local


@dataclass
class Result:
    """What a context-parallel run measured (details["context"]); per rank: one entry a rank, in rank order."""

    FAMILY: ClassVar[str] = "context"
    cp: int = 1  # ranks per context-parallel group
    layout: str = ""  # contiguous, zigzag; a2a (ulysses), "a2a 2 x zigzag" with a ring of 2 inside
    comm: str = ""  # ring, allgather; "" for the all-to-all alone
    kv_block_bytes: float = 0.0  # one rank's K,V block, one attention layer
    attention_bytes_predicted: float = 0.0  # per rank and step: the ring's 3 (cp-1) blocks a layer; a2a_bytes
    causal_pairs_per_rank: list = field(default_factory=list)  # (q, k) pairs per head, sequence, attention call
    causal_pairs_formula: list = field(default_factory=list)  # the layout's sum over positions, ranks 0..cp-1
    attention_ms_per_rank: list = field(default_factory=list)  # its attention alone, forward and backward
    activation_bytes_per_rank: list = field(default_factory=list)  # saved for backward, its slice
    attention_activation_bytes_per_rank: list = field(default_factory=list)  # of them, inside attention
    single_activation_bytes_per_rank: list = field(default_factory=list)  # the whole sequence on one device
    single_attention_activation_bytes_per_rank: list = field(default_factory=list)
    bytes_by_ranks: dict = field(default_factory=dict)  # {"ranks", "ring", "a2a"}: each mode's formula at 2-16


class Context(measure.Family):
    """Context parallelism measured. `dims`: (config, dist=None) -> the ParallelDims of dp x cp; `loss`:
    (t, batch) -> the mean loss over this rank's slice; `fsdp_blocks`: model -> the blocks FSDP2 shards
    over every rank (fsdp_cp), None where the gradients are all-reduced (context_parallel)."""

    def __init__(self, dims, loss, fsdp_blocks=None, attention_bytes=None):
        self.dims, self.loss, self.fsdp_blocks = dims, loss, fsdp_blocks
        self.attention_bytes = attention_bytes or attention_bytes_predicted

    def comm_bytes_predicted(self, model, run) -> float:
        """The K,V ring and the gradients' reduction: one all-reduce of every gradient, or FSDP2's
        collectives of the parameters, each (N-1)/N of their bytes: a reduce-scatter, and an all-gather in
        forward and again in backward, but the root's parameters (those no block holds: the embeddings)
        are gathered once, as FSDP2 keeps the root unsharded between its forward and backward."""
        ring = self.attention_bytes(model, run, self.dims(run).cp)
        if self.fsdp_blocks is None:
            return ring + allreduce_every_gradient(model, run)
        n, p = run.world_size, param_bytes(model.parameters())
        in_blocks = param_bytes(q for b in self.fsdp_blocks(model) for q in b.parameters())
        return ring + (n - 1) / n * (2 * in_blocks + (p - in_blocks) + p)

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        """Bytes beside the formula, each rank's causal pairs and attention time, activations per rank."""
        lay, a, seq = self.dims(run, dist), t.model.attentions()[0], run.workload.input_shape[0]
        cp, batch, attend = lay.cp, data.batch(0, *lay.batch_share(dist.rank)), a.attend  # each layer's Ring, Ulysses
        with counting_pairs(attend, a.q.out_features // a.head_size) as pairs:
            mine, mine_attention = saved_bytes(t.model, lambda: self.loss(t, batch))
        whole, whole_attention = single_saved_bytes(t.model, t.loss_fn, [b.to(t.device) for b in batch])
        ms = round(attention_ms(t.model, attend, len(batch[0]), t.device, seq), 3)
        out = Result(cp, *kind(attend), kv_bytes(t.model, run, cp), self.attention_bytes(t.model, run, cp),
                     causal_pairs_per_rank=every_rank(round(pairs[0] / len(t.model.attentions()))),
                     causal_pairs_formula=pairs_formula(attend, seq, cp),
                     attention_ms_per_rank=every_rank(ms),
                     activation_bytes_per_rank=every_rank(mine),
                     attention_activation_bytes_per_rank=every_rank(mine_attention),
                     single_activation_bytes_per_rank=every_rank(whole),
                     single_attention_activation_bytes_per_rank=every_rank(whole_attention),
                     bytes_by_ranks=bytes_by_ranks(t.model, run, cp))
        return {"bytes_per_step_by_collective": result.wire.per_step(), Result.FAMILY: out}


# What is predicted -------------------------------------------------------------------------------------


def kv_bytes(model: nn.Module, run, cp: int) -> float:
    """The bytes of one rank's K,V block, one attention layer: 2 x (B/dp) x (T/cp) x width x 4 (2 under
    --precision bf16: the projections' outputs are bf16 there; 8 under fp64)."""
    return _kv(model, run.batch_size // (run.world_size // cp), run.workload.input_shape[0], cp, _element(run))


def _kv(model: nn.Module, rows: int, seq: int, cp: int, element: int) -> float:
    """kv_bytes for `rows` sequences of `seq` positions over cp ranks."""
    return 2 * rows * (seq // cp) * model.attentions()[0].q.out_features * element


def attention_bytes_predicted(model: nn.Module, run, cp: int) -> float:
    """K,V around the group, per rank and step: 3 (cp-1) blocks per attention layer, forward and backward
    (kit/ring_attention.py's module docstring), for either comm."""
    return 3 * (cp - 1) * kv_bytes(model, run, cp) * len(model.attentions())


def a2a_bytes_predicted(model: nn.Module, run, cp: int) -> float:
    """Ulysses per rank and step (kit/ulysses.py): each attention layer's four all-to-alls forward (q, k, v,
    out) and four backward (their gradients), each (U-1)/U of a tensor at s/cp positions, k and v with the
    kv heads they carry; with --ring R, beside them the ring's 3 (R-1) K,V blocks of s/R positions and
    H/U heads (U = cp / R)."""
    rows = run.batch_size // (run.world_size // cp)
    return _a2a(model, rows, run.workload.input_shape[0], cp, run.options.ring, _element(run))


def _a2a(model: nn.Module, rows: int, seq: int, cp: int, ring: int, element: int) -> float:
    """a2a_bytes_predicted for `rows` sequences of `seq` positions over cp ranks, a ring of `ring` inside."""
    a, u, positions = model.attentions()[0], cp // ring, seq // cp
    width = a.q.out_features
    kv = kv_heads_sent(a.k.out_features // a.head_size, u) * a.head_size
    a2a = 2 * (u - 1) / u * rows * positions * (2 * width + 2 * kv) * element
    around = 3 * (ring - 1) * 2 * rows * positions * u * (width // u) * element
    return (a2a + around) * len(model.attentions())


def bytes_by_ranks(model: nn.Module, run, cp: int) -> dict[str, list]:
    """The ring's and the all-to-all's attention bytes per rank and step by their formulas, had P = 2, 4, 8, 16
    ranks split this run's sequences (its batch share a group, its heads): the ring's near constant, the
    all-to-all's falling as 1/P; None where the heads bound the all-to-all. Where their lines cross."""
    a, seq, element = model.attentions()[0], run.workload.input_shape[0], _element(run)
    rows, out = run.batch_size // (run.world_size // cp), defaultdict(list)
    for p in (2, 4, 8, 16):
        if seq % (2 * p) == 0:
            out["ranks"].append(p)
            out["ring"].append(3 * (p - 1) * _kv(model, rows, seq, p, element) * len(model.attentions()))
            out["a2a"].append(None if heads_problem(a.q.out_features // a.head_size, a.k.out_features // a.head_size,
                                                    p) else _a2a(model, rows, seq, p, 1, element))
    return dict(out)


def _element(run) -> int:
    """Bytes an element of attention's inputs: 2 under bf16 (the projections' outputs), else the precision's."""
    return 2 if run.precision == "bf16" else element_bytes(run.precision)


# What is measured --------------------------------------------------------------------------------------


def _ring_of(attend) -> Ring | None:
    """The ring an attention passes K,V around: itself, the one inside a Ulysses, or None."""
    return attend if isinstance(attend, Ring) else attend.ring


def kind(attend) -> tuple[str, str]:
    """(layout, comm) of a Ring or a Ulysses, for the table: "zigzag", "ring"; "a2a", ""; "a2a 2 x zigzag", "ring"."""
    if isinstance(attend, Ring):
        return attend.split.name, attend.comm
    ring = attend.ring
    return ("a2a", "") if ring is None else (f"a2a {attend.size} x {ring.split.name}", ring.comm)


def pairs_formula(attend, seq: int, cp: int) -> list[int]:
    """The causal (q, k) pairs per head and sequence of each rank of the group, by its layout: the ring's sum
    over positions; under Ulysses the whole sequence's, or its ring rank's, over U (its 1/U of the heads)."""
    if isinstance(attend, Ring):
        return [attend.split.causal_pairs(r) for r in range(cp)]
    u, ring = attend.size, attend.ring
    return [(seq * (seq + 1) // 2 if ring is None else ring.split.causal_pairs(c // u)) // u for c in range(cp)]


@contextlib.contextmanager
def counting_pairs(attend, heads: int):
    """Yields [pairs]: the (query, key) pairs per head of the model and sequence of every product the
    attention hands its kernels inside the block: the ring's counted by wrapping its `blocks`, Ulysses'
    by wrapping its `attention` (the heads it was given over the model's), on the instances."""
    total, share, ring, wrapped = [0.0], [1.0], _ring_of(attend), []
    if ring is not None:
        blocks = ring.blocks

        def counted(src):
            out = blocks(src)
            total[0] += share[0] * sum((qi.stop - qi.start) * (ki.stop - ki.start) - (0 if m is None else int(m.sum()))
                                       for qi, ki, m, _ in out)
            return out

        ring.blocks = counted
        wrapped.append((ring, "blocks"))
    if not isinstance(attend, Ring):
        attention = attend.attention

        def counted_attention(q, k, v):
            share[0], length = q.shape[1] / heads, q.shape[2]
            if ring is None:  # one causal product over the group's whole sequence
                total[0] += share[0] * length * (length + 1) // 2
            return attention(q, k, v)

        attend.attention = counted_attention
        wrapped.append((attend, "attention"))
    try:
        yield total
    finally:
        for holder, name in wrapped:
            delattr(holder, name)  # the class's method again


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
        call.grouped = getattr(attend, "grouped", False)  # k, v as the attention takes them (kit/ulysses.py)
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


def attention_ms(model: nn.Module, attend, batch_rows: int, device, seq: int, rounds: int = 5) -> float:
    """Median ms of this rank's attention work, forward and backward, without communication: the ring's
    every block of the group held locally (the causal work its layout gives it); Ulysses' attention on
    its heads over the group's positions."""
    a = model.attentions()[0]
    heads, d = a.q.out_features // a.head_size, a.head_size
    ring = _ring_of(attend)
    length = len(ring.split.positions(ring.rank)) if ring is not None else None
    if not isinstance(attend, Ring):
        heads, length = heads // attend.size, length or seq
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_rows, heads, length, d, generator=g).to(device) for _ in range(3))
    sync, times, work = synchronizer(device), [], causal_alone if ring is None else functools.partial(work_alone, ring)
    for i in range(rounds + 1):
        sync()
        start = time.perf_counter()
        work(q, k, v)
        sync()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def causal_alone(q, k, v) -> None:
    """Causal attention forward and backward on these tensors, as Ulysses' ranks compute it."""
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # transformer.causal
    torch.autograd.grad(out, (q, k, v), out)
