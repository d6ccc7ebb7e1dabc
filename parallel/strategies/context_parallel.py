"""context_parallel: every sequence split between ranks, attention by a ring of K,V blocks (by hand).

    torchrun --nproc_per_node=2 scripts/context_parallel.py --workload transformer --seq-len 256 \\
        [--cp-layout contiguous|zigzag] [--cp-comm ring|allgather] [--cp C]

The diff from `single`: each of the C ranks of a context-parallel group keeps its slice of every sequence
of its share of the batch (the same share for the whole group; dp = N / C groups take a share each), and
feeds the model that slice with the slice's global positions (the position embedding and the causal
mask need them). Everything but attention is per token, so it runs on the slice unchanged; attention
needs every earlier token's K,V, which `ring_attention` brings around the group:

    rank 0 (positions 0-7)   q0 . [K,V]0  ->  q0 . [K,V]1 (masked: all later)
    rank 1 (positions 8-15)  q1 . [K,V]1  ->  q1 . [K,V]0 (all earlier)          merged by log-sum-exp

Each rank's loss is the mean over its own tokens, an equal share, so the mean of the ranks' losses is
`single`'s loss over the whole batch. The weights are replicated: after backward the gradients are
averaged over all N ranks (dp x cp) in one flat all-reduce, as the anchors do (torchtitan folds cp into
the data-parallel group of FSDP: `fsdp_cp`). --cp-layout zigzag (the default) gives rank r chunks r and
2C-1-r, which balances the causal work; contiguous gives the last rank the most.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as td
from torch import nn

from parallel.devices import SHARED_GLOO_NO_P2P, synchronizer
from parallel.errors import ConfigError
from parallel.formulas import element_bytes
from parallel.kit.collectives import every_rank, sum_gradients
from parallel.kit.ring_attention import COMMS, LAYOUTS, Layout, Ring, split_check, work_alone
from parallel.kit.tensors import local
from parallel.layout import ParallelDims
from parallel.measure.sharded import allreduce_every_gradient
from parallel.strategies.base import Hooks, Mutant, Trainable, injected, options_of
from parallel.usermodel import workload_of

NAME = "context_parallel"
LAUNCH = "torchrun"
SYNCHRONOUS = True
LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)
SEQUENCE = True  # it replaces the model's attention (model.attentions())

_ZIGZAG = {"workload": "transformer", "options": {"cp_layout": "zigzag"}}
NOT_DIFFERENTIABLE = Mutant("context_parallel:rotation-not-differentiable", "K,V passed around the ring by "
                            "isend/irecv with autograd through the local merge only: dK,dV never go back to "
                            "their owner", {"workload": "transformer", "options": {"cp_layout": "contiguous"}})
ZIGZAG_UNPERMUTED = Mutant("context_parallel:zigzag-positions-unpermuted", "tokens sliced zig-zag, but positions "
                           "(embedding and mask) taken as if contiguous", _ZIGZAG)
LSE_SWAPPED = Mutant("context_parallel:lse-weights-swapped", "the online softmax merges two partial results "
                     "with each other's weight", _ZIGZAG)
LOCAL_MASK = Mutant("context_parallel:local-causal-mask", "the causal mask built from positions within the "
                    "rank's slice, not the global ones", _ZIGZAG)
MUTANTS = (NOT_DIFFERENTIABLE, ZIGZAG_UNPERMUTED, LSE_SWAPPED, LOCAL_MASK)


@dataclass
class Options:
    cp_layout: str = field(default="zigzag", metadata={"help": "which positions a rank holds: contiguous, or "
                                                               "zigzag (chunks r and 2C-1-r: balanced)"})
    cp_comm: str = field(default="ring", metadata={"help": "ring (K,V passed rank to rank) or allgather (K,V "
                                                           "all-gathered, dK,dV reduce-scattered)"})
    cp: int = field(default=0, metadata={"help": "ranks per context-parallel group; the rest data parallel "
                                                 "(0: context_parallel every rank, fsdp_cp 2)"})

    def __post_init__(self):
        if self.cp_layout not in LAYOUTS:
            raise ConfigError(f"--cp-layout must be one of {', '.join(LAYOUTS)}, got {self.cp_layout!r}")
        if self.cp_comm not in COMMS:
            raise ConfigError(f"--cp-comm must be one of {', '.join(COMMS)}, got {self.cp_comm!r}")
        if self.cp < 0:
            raise ConfigError(f"--cp must be 0 (the default) or more, got {self.cp}")


def cp_of(config, default: int = 0) -> int:
    """The ranks per context-parallel group: --cp, or `default` (0: every rank)."""
    return options_of(Options, config).cp or default or config.world_size


def layout_of(config, cp: int) -> ParallelDims:
    return ParallelDims(world=config.world_size, dp_replicate=config.world_size // cp, cp=cp)


def dims(config, dist) -> ParallelDims:
    return layout_of(config, cp_of(config))


def check_cp(config, cp: int) -> None:
    """What every context-parallel strategy needs of a config, with `cp` ranks per group."""
    o, n = options_of(Options, config), config.world_size
    if n % cp:
        raise ConfigError(f"--cp {cp} does not divide the {n} devices")
    if cp == 1 and n > 1:
        raise ConfigError("--cp 1 splits no sequence: that is data parallel (manual_ddp, ddp)")
    config.check_divisible(n // cp, "data-parallel groups")
    if why := split_check(o.cp_layout, cp, workload_of(config).input_shape[0]):
        raise ConfigError(why)
    if o.cp_comm == "ring" and config.spec.shared:
        raise ConfigError(f"--cp-comm ring: {SHARED_GLOO_NO_P2P}; --cp-comm allgather runs there")


def check(config) -> None:
    check_cp(config, cp_of(config))


@dataclass
class State:
    ring: Ring  # shared by every attention layer: the group, the positions it masks by, its counts
    index: torch.Tensor  # which positions of a sequence this rank keeps: on the CPU, where batches are made
    positions: torch.Tensor  # the global positions it gives the model (the same, but for a bug)
    world: int


def install(model: nn.Module, config, dist, dims_: ParallelDims) -> State:
    """Put this rank's ring attention in every attention layer of `model`; what a step needs to slice."""
    o = options_of(Options, config)
    seq = workload_of(config).input_shape[0]
    mesh = dims_.mesh(dist.device.type)
    group = mesh.get_group("cp") if dims_.cp > 1 else None  # None: a world of one
    cp_rank = dims_.coords(dist.rank)["cp"]
    layout = Layout(o.cp_layout, dims_.cp, seq)
    seen = Layout("contiguous", dims_.cp, seq) if injected(config, ZIGZAG_UNPERMUTED) else layout
    ring = Ring(group, seen, o.cp_comm, swap_lse=injected(config, LSE_SWAPPED),
                local_mask=injected(config, LOCAL_MASK), keep_grads_home=injected(config, NOT_DIFFERENTIABLE))
    for attention in model.attentions():
        attention.attend = ring
    return State(ring, layout.positions(cp_rank), seen.positions(cp_rank).to(dist.device),
                 dist.world_size)


def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable:
    model = model.to(dist.device)
    state = install(model, config, dist, dims(config, dist))
    for p in model.parameters():  # every rank starts from rank 0's weights (they are built alike anyway)
        td.broadcast(p.detach(), src=0)
    return Trainable(model, make_optimizer(model.parameters()), loss_fn, dist.device, state=state)


def local_loss(t: Trainable, batch):
    """The mean loss over this rank's slice of every sequence of its share of the batch."""
    s = t.state
    x, y = (b[:, s.index.to(b.device)].to(t.device, non_blocking=True) for b in batch)  # (B/dp, T/cp) each
    return t.loss_fn(t.model(x, positions=s.positions), y)


def train_step(t: Trainable, batch, dist):
    s = t.state
    t.optimizer.zero_grad(set_to_none=True)
    loss = local_loss(t, batch)
    loss.backward()  # ring attention's backward carries every block's dK,dV back to its owner
    average_gradients(list(t.model.parameters()), s.world)
    t.optimizer.step()
    return loss.detach()


def average_gradients(params: list[nn.Parameter], world: int) -> None:
    """Every gradient averaged over the world, in one flat all-reduce (the sum over dp x cp: each rank's
    gradient is of its own tokens' mean)."""
    sum_gradients(params, world)


def kv_bytes(model: nn.Module, config, cp: int) -> float:
    """The bytes of one rank's K,V block, one attention layer: 2 x (B/dp) x (T/cp) x width x 4 (2 under
    --precision bf16: the projections' outputs are bf16 there; 8 under fp64)."""
    width, element = model.attentions()[0].q.out_features, 2 if config.precision == "bf16" else element_bytes(
        config.precision)
    rows, positions = config.batch_size // (config.world_size // cp), workload_of(config).input_shape[0] // cp
    return 2 * rows * positions * width * element


def attention_bytes_predicted(model: nn.Module, config, cp: int) -> float:
    """K,V around the group, per rank and step: 3 (cp-1) blocks per attention layer, forward and backward
    (ring_attention's module docstring), for either comm."""
    return 3 * (cp - 1) * kv_bytes(model, config, cp) * len(model.attentions())


def comm_bytes_predicted(model, config) -> float:
    return attention_bytes_predicted(model, config, cp_of(config)) + allreduce_every_gradient(model, config)


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


def _saved_bytes(model: nn.Module, run) -> tuple[int, int]:
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
        run()
    return totals[0], totals[1]


def activations(t: Trainable, batch) -> dict:
    """Activation bytes of this rank's slice against the whole sequence on one device (the same model,
    torch's attention, this process): what splitting the sequence saves."""
    from parallel.transformer import causal

    x, y = (b.to(t.device) for b in batch)
    mine = _saved_bytes(t.model, lambda: local_loss(t, batch))
    with attending(t.model, lambda _: causal):
        whole = _saved_bytes(t.model, lambda: t.loss_fn(t.model(x), y))
    return {"activation_bytes": mine[0], "attention_activation_bytes": mine[1],
            "single_activation_bytes": whole[0], "single_attention_activation_bytes": whole[1]}


def attention_ms(t: Trainable, batch_rows: int, rounds: int = 5) -> float:
    """Median ms of this rank's attention work, forward and backward, every block of the group held
    locally (no communication): the causal work its layout gives it."""
    a = t.model.attentions()[0]
    heads, d = a.q.out_features // a.head_size, a.head_size
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(batch_rows, heads, len(t.state.index), d, generator=g).to(t.device) for _ in range(3))
    sync, times = synchronizer(t.device), []
    for i in range(rounds + 1):
        sync()
        start = time.perf_counter()
        work_alone(t.state.ring, q, k, v)
        sync()
        if i:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def cp_measurements(t: Trainable, data, config, dist, result, cp: int) -> dict:
    """Bytes beside the formula, each rank's causal pairs and attention time, activations per rank."""
    s = t.state
    batch = data.batch(0, *layout_of(config, cp).batch_share(dist.rank))
    out = {"bytes_per_step_by_collective": result.wire.per_step(), "cp": cp, "cp_layout": s.ring.layout.name,
           "cp_comm": s.ring.comm,
           "kv_block_bytes": kv_bytes(t.model, config, cp),
           "attention_bytes_predicted": attention_bytes_predicted(t.model, config, cp),
           "causal_pairs_per_rank": every_rank(s.ring.pairs // max(1, s.ring.calls)),
           "causal_pairs_formula": [s.ring.layout.causal_pairs(r) for r in range(cp)],
           "attention_ms_per_rank": every_rank(round(attention_ms(t, batch[0].shape[0]), 3))}
    for k, v in activations(t, batch).items():
        out[f"{k}_per_rank"] = every_rank(v)
    return out


def extra_measurements(t: Trainable, data, config, dist, result) -> dict:
    return cp_measurements(t, data, config, dist, result, cp_of(config))


HOOKS = Hooks(dims=dims, check=check, comm_bytes_predicted=comm_bytes_predicted,
              extra_measurements=extra_measurements)
