"""Bytes on the wire, counted where the collectives happen, by kind. THE loop counts every strategy's:

    counter = wire.Counter(config.warmup)    # train.train
    with counter.step():                     # around each train_step: the warm-up steps counted
        loss = strategy.train_step(...)

and `wire.counted(sent)` counts any block of code into a dict (the tests' use).

A TorchDispatchMode sees every operation torch dispatches, the collectives among them: torch.distributed's
own calls (`c10d::_allgather_base_`, `c10d::allreduce_`, ...: DDP's comm hooks, ZeroRedundancyOptimizer's
broadcasts, FSDP2's all-gathers and reduce-scatters) and DTensor's functional ones
(`_c10d_functional::all_reduce`, ...). Each adds what this rank sends over a ring of the n ranks of its
group (the nccl-tests "bus bandwidth" convention), from the sizes of the tensors it is given:

    all-reduce       2 (n-1)/n x payload        reduce-scatter   (n-1)/n x its (whole) input
    all-gather       (n-1) x its input (one shard: (n-1)/n of the gathered output)
    broadcast        (n-1)/n x payload          all-to-all       its input but its own chunk (the
                                                                 splits as given: permute_tensor sends all)
    send             the payload                (a receive is counted at its sender)

An operation on a DTensor is handed to DTensor first (the mode returns NotImplemented for it), so that
the collectives DTensor runs inside it (a Partial gradient made Replicate at the optimizer's step, say)
come through the mode too; a mode that ran the operation itself would not see them (measured: the
all-reduce of `replicated.add_(partial)` is missed). torch's `CommDebugMode`
(torch.distributed.tensor.debug) counts collectives too but gives no bytes. DDP's
reducer calls the process group from C++ when it has no comm hook, past the dispatcher: a strategy that
wants those counted registers a hook (ddp, zero_optimizer do). The mode costs a Python call for every
operation, about 3 microseconds each (measured on this 2-core machine against 0.9 us for a small add),
so `Counter` counts the warm-up steps, off the clock, and not the timed ones.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading

import torch
import torch.distributed
from torch.utils._python_dispatch import TorchDispatchMode

# Operation name (namespace and overload dropped) -> (kind, the argument holding what is sent,
# the share of that argument's bytes a rank sends given the group's size n).
_ALL_REDUCE = lambda n: 2 * (n - 1) / n  # noqa: E731 (a table of one-line formulas)
_SHARE = lambda n: (n - 1) / n  # noqa: E731
_ALL_GATHER = lambda n: n - 1  # noqa: E731
_WHOLE = lambda n: 1.0  # noqa: E731
OPS: dict[str, tuple[str, tuple[str, ...], object]] = {
    **{op: ("all_reduce", ("tensors", "inputs", "input"), _ALL_REDUCE) for op in (
        "allreduce_", "allreduce_coalesced_", "all_reduce", "all_reduce_", "all_reduce_coalesced",
        "all_reduce_coalesced_")},
    **{op: ("all_gather", ("input_tensor", "input_tensors", "input_list", "inputs", "input"), _ALL_GATHER)
       for op in ("allgather_", "_allgather_base_", "allgather_coalesced_", "allgather_into_tensor_coalesced_",
                  "all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced")},
    **{op: ("reduce_scatter", ("input_tensor", "input_tensors", "inputs", "input"), _SHARE) for op in (
        "reduce_scatter_", "_reduce_scatter_base_", "reduce_scatter_tensor_coalesced_", "reduce_scatter_tensor",
        "reduce_scatter_tensor_out", "reduce_scatter_tensor_coalesced")},
    **{op: ("broadcast", ("tensors", "input"), _SHARE) for op in ("broadcast_", "broadcast")},
    **{op: ("all_to_all", ("input_tensors", "input"), None) for op in ("alltoall_", "alltoall_base_",
                                                                        "all_to_all_single")},  # _all_to_all
    **{op: ("send", ("tensors", "tensor"), _WHOLE) for op in ("send", "isend")},
}
NAMESPACES = ("c10d", "_c10d_functional")


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group(bound: dict):
    if "process_group" in bound:  # the dispatcher's boxed (TorchScript) form of the group
        return torch.distributed.ProcessGroup.unbox(bound["process_group"])
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(bound["group_name"])


def _group_size(bound: dict) -> int:
    return int(bound["group_size"]) if "group_size" in bound else _group(bound).size()


def _all_to_all(bound: dict) -> float:
    """Bytes this rank sends in an all-to-all: every chunk of its input but the one it keeps, with the
    splits as given (uneven, or all of it to one peer as permute_tensor does), equal chunks without."""
    group = _group(bound)
    n, rank = group.size(), group.rank()
    if "input_tensors" in bound:  # alltoall_: one tensor per destination rank
        return float(sum(_nbytes(t) for i, t in enumerate(bound["input_tensors"]) if i != rank))
    x, splits = bound["input"], [int(v) for v in bound.get("input_split_sizes") or ()]
    if not splits:
        return (n - 1) / n * _nbytes(x)
    return _nbytes(x) / max(1, x.shape[0]) * (sum(splits) - splits[rank])  # splits count rows (dim 0)


def bytes_sent(func, args, kwargs) -> tuple[str, float] | None:
    """(kind, bytes this rank sends) for a collective operation, None for any other operation."""
    if func.namespace not in NAMESPACES:
        return None
    name = func._schema.name.split("::")[-1]
    if name == "batch_p2p_ops":  # (ops, peers, tags, tensors, group): the sends among them
        return "send", float(sum(_nbytes(t) for op, t in zip(args[0], args[3], strict=True) if op == "isend"))
    if name not in OPS:
        return None  # a receive, a barrier, wait_tensor: nothing sent
    kind, inputs, share = OPS[name]
    bound = {a.name: v for a, v in zip(func._schema.arguments, args, strict=False)} | (kwargs or {})
    if share is None:
        return kind, _all_to_all(bound)
    payload = next(_nbytes(bound[k]) for k in inputs if k in bound)
    return kind, share(_group_size(bound)) * payload


class _Counting(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtensor = sys.modules.get("torch.distributed.tensor")
        if dtensor is not None and any(issubclass(t, dtensor.DTensor) for t in types):
            return NotImplemented  # a DTensor first: the collectives its own dispatch runs then come through here
        if (counted := bytes_sent(func, args, kwargs)) is not None:
            self.counter.add(*counted)
        return func(*args, **(kwargs or {}))


class Counter:
    """The loop's count of every rank's collectives, kept off the clock: the mode runs through the first
    `steps` steps of the run (its warm-up steps, which the loop does not time) and the timed steps run
    without it; the figures per step are those of the counted steps. steps=0 (a run without warm-up)
    counts every step. THE loop (parallel/loop/train.py) opens one around every strategy's step; no strategy
    opens its own:

        counter = wire.Counter(config.warmup)
        with counter.step(): ...                     # around each train_step

    By kind: bytes sent (`sent`), collectives (`calls`), bytes sent inside backward (`backward`); given a
    model with `blocks` (the transformer), also the collectives run while one of its `blocks.<i>` runs,
    forward or backward (torch's ModTracker), for counts per block (`in_blocks`, their bytes
    `in_blocks_bytes`). Copies between the devices one process drives are not collectives: the building
    blocks that make them report them (`moved`).
    """

    def __init__(self, steps: int, model: torch.nn.Module | None = None):
        self.steps = steps
        self.blocks = len(getattr(model, "blocks", ()))  # 0: no per-block counts
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.backward: dict[str, float] = {}
        self.in_blocks: dict[str, int] = {}
        self.in_blocks_bytes: dict[str, float] = {}
        self.counted = 0  # steps counted so far
        self.seen = 0
        self._tracker = None

    def add(self, kind: str, nbytes: float) -> None:
        self.sent[kind] = self.sent.get(kind, 0.0) + nbytes
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if torch._C._current_graph_task_id() != -1:  # inside autograd's backward
            self.backward[kind] = self.backward.get(kind, 0.0) + nbytes
        if self._tracker is not None and any(_BLOCK.search(name) for name in self._tracker.parents):
            self.in_blocks[kind] = self.in_blocks.get(kind, 0) + 1
            self.in_blocks_bytes[kind] = self.in_blocks_bytes.get(kind, 0.0) + nbytes

    @property
    def total(self) -> float:
        return sum(self.sent.values())

    def per_step(self, what: str = "sent") -> dict[str, float]:
        """`what` ("sent", "calls", "backward", "in_blocks", "in_blocks_bytes") per counted step, by kind."""
        return {k: v / max(1, self.counted) for k, v in getattr(self, what).items()}

    def measurements(self) -> dict:
        """The row's details: per counted step, collectives and bytes by kind and the bytes sent inside
        backward; with blocks, the collectives and bytes per block."""
        out = {"collectives_per_step": self.per_step("calls"), "bytes_per_step_by_collective": self.per_step(),
               "backward_bytes_per_step": self.per_step("backward")}
        if self.blocks:
            out["collectives_per_block_per_step"] = {k: v / self.blocks for k, v in self.per_step("in_blocks").items()}
            out["bytes_per_block_per_step"] = {k: v / self.blocks
                                               for k, v in self.per_step("in_blocks_bytes").items()}
        return out

    @contextlib.contextmanager
    def step(self):
        global _active
        self.seen += 1
        if self.steps and self.seen > self.steps:
            yield
            return
        _active = self
        with contextlib.ExitStack() as stack:
            if self.blocks:
                from torch.distributed._tools.mod_tracker import ModTracker

                self._tracker = stack.enter_context(ModTracker())
            stack.enter_context(_Counting(self))
            try:
                yield
            finally:
                _active = None
        self._tracker = None
        self.counted += 1


_active: Counter | None = None  # the counter of the step being counted, if one is


def counting() -> bool:
    """Is this step one the loop counts (a warm-up step)? A building block that counts more than bytes
    (expert dispatch's rows) counts in the same steps."""
    return _active is not None


def moved(tensors, times: int = 1, kind: str = "copy") -> None:
    """`tensors` copied `times` over between two devices of one process (a virtual or real device's copy,
    no collective the mode could see), counted as sent when this step is counted: the in-process building
    blocks call it (kit.primitives' scatter, gather and replicate; kit.stages' hand-offs). Their sizes are
    read only then: the timed steps pay nothing."""
    if _active is not None:
        nbytes = times * sum(t.numel() * t.element_size() for t in tensors)
        with _MOVES:  # the stages' threads of one process report at once
            _active.add(kind, nbytes)


_MOVES = threading.Lock()


_BLOCK = re.compile(r"\.blocks\.\d+(\.|$)")  # ModTracker's names: "Transformer.blocks.0.attn"


@contextlib.contextmanager
def counted(sent: dict[str, float]):
    """Add the bytes of every collective this rank runs inside the block to `sent`, by kind."""
    counter = Counter(0)
    with _Counting(counter):
        yield sent
    for kind, nbytes in counter.sent.items():
        sent[kind] = sent.get(kind, 0.0) + nbytes


