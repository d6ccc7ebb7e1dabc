"""--check-replicas: after every step, whether what should be identical across ranks still is.

    check = divergence.Check(config, dims, dist, trainable)   # once, before the loop
    check.after(step, loss)                                   # after each step, once the timer has stopped

Every rank takes an exact checksum of each parameter and buffer of its model, of each gradient an
optimiser stepped with (NAME.grad) and of the step's loss; the checksums are gathered to every rank (one
all_gather_object a step) and compared within each group of ranks that must hold the same copy (`peers`).
The first disagreement is kept as one line naming the step, the tensor and two ranks; the run goes on,
so that the oracle's final verdict against one device is given beside it.

The rule is bitwise equality. Replicas stay identical by construction, not by rounding: every rank
applies the same update to the same bits, and an all-reduce hands every rank the same result (gloo's and
NCCL's do; DDP relies on it and never re-broadcasts its parameters). One flipped bit is a replica that
has started to train on its own, however small the difference: a tolerance would only hide when it began.

Timings under --check-replicas include its collectives between steps, never inside one: the check runs
after the step's clock has stopped and outside the counted collectives (wire.Counter).
"""

from __future__ import annotations

import torch
import torch.distributed as td

from parallel.world.dist import local

_CHUNK = 1 << 22  # words summed at once: bounds the checksum's own memory on a large tensor


def checksum(t: torch.Tensor) -> torch.Tensor:
    """An exact fingerprint of `t`'s bits, (2,) int64 on its device: the sum of its words and their sum
    weighted by position (1, 2, 3, ...), so that any changed bit changes the first or both, and two swapped
    words change the second. Words of 4 bytes where the size allows (2, then 1), whatever the tensor's place
    in its storage, taken as signed integers; sums wrap around, which a fingerprint may."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    if raw.storage_offset() % 4:  # a view off a word's boundary (a bucket's bf16 gradient) cannot be read as words
        raw = raw.clone()
    word = next(d for d, n in ((torch.int32, 4), (torch.int16, 2), (torch.uint8, 1)) if raw.numel() % n == 0)
    words = raw.view(word)
    out = torch.zeros(2, dtype=torch.int64, device=t.device)
    for start in range(0, words.numel(), _CHUNK):
        part = words[start:start + _CHUNK].to(torch.int64)
        place = torch.arange(start + 1, start + 1 + part.numel(), dtype=torch.int64, device=t.device)
        out += torch.stack([part.sum(), (part * place).sum()])
    return out


def peers(t: torch.Tensor | None, dims, rank: int) -> tuple[int, ...]:
    """The ranks that must hold the same bits as `rank` (itself among them), by what they promise:

    - a DTensor (FSDP2, DTensor tensor parallelism): its local shard is the same on every rank of its own
      mesh that differs from this one only along dimensions whose placement is Replicate. Shard and
      Partial dimensions hold different pieces, so the ranks along them are not compared.
    - a plain tensor: the same on every rank that differs only in its dp_replicate or cp coordinate (a
      data-parallel replica, or a context-parallel rank, which splits the sequence and never the weights).
      A tp, pp or dp_shard coordinate of its own may hold its own slice, stage or shard.
    - the loss (t None): the same on every tensor-parallel rank of a group (each ends with the whole
      output), and only on the stage that computes it (dims.loss_pp); dp and cp ranks average different
      samples or pieces of sequence, so their losses differ by design. No peers where the rank holds none.
    """
    from torch.distributed.tensor import DTensor, Replicate  # torch.distributed's heavy part, on use

    if isinstance(t, DTensor):
        mesh, at = t.device_mesh, t.device_mesh.get_coordinate()
        if at is None:
            return ()
        where = tuple(slice(None) if isinstance(p, Replicate) else at[d] for d, p in enumerate(t.placements))
        return tuple(sorted(mesh.mesh[where].reshape(-1).tolist()))
    mine = dims.coords(rank)
    if t is None and mine["pp"] != dims.loss_pp % dims.pp:
        return ()
    free = ("tp",) if t is None else ("dp_replicate", "cp")
    return tuple(r for r in range(dims.world)
                 if all(c == mine[k] for k, c in dims.coords(r).items() if k not in free))


def checksums(trainable, loss: torch.Tensor, dims, rank: int, stepped: dict | None = None) -> list[tuple]:
    """(name, peers, fingerprint) for the step's loss ("loss"), every gradient (NAME.grad), parameter and
    buffer of this rank that some other rank must hold too (`peers`, or the strategy's own word for a
    tensor, Trainable.held_by: an expert's replicas); one copy to the host for them all. A
    gradient counts only as an optimiser took it (`stepped`: Gradients.stepped): one it never stepped
    with (ZeRO's, whose reduced part is a shard the optimiser holds apart) or that changed after (the
    DCGAN's discriminator, which the generator's backward passes through) was never promised alike."""
    params, stepped = list(trainable.model.named_parameters()), stepped or {}
    # In the order a step makes them, so that the first to part names the cause: the loss, the gradients
    # (by their own placements: a Partial one is reduced inside the optimiser's step), parameters, buffers.
    grads = [(name, p.grad) for name, p in params if p.grad is not None and stepped.get(id(p)) == _mark(p.grad)]
    named = [("loss", peers(None, dims, rank), loss)]
    for suffix, tensors in ((".grad", grads), ("", params), ("", trainable.model.named_buffers())):
        named += [(name.removeprefix("module.") + suffix, trainable.held_by.get(name) or peers(t, dims, rank), t)
                  for name, t in tensors]  # named as the oracle names them: without DDP's wrapper
    kept = [entry for entry in named if len(entry[1]) > 1]
    if not kept:
        return []
    sums = [checksum(local(t)) for _, _, t in kept]
    sums = torch.stack([s.to(sums[0].device) for s in sums]).cpu().tolist()  # one wait for the device
    return [(name, group, (str(local(t).dtype), tuple(local(t).shape), *s))
            for (name, group, t), s in zip(kept, sums, strict=True)]


def _mark(grad: torch.Tensor) -> tuple[int, int]:
    """Which gradient tensor, at which in-place version: changed by anything written to it since."""
    return id(grad), grad._version


class Gradients:
    """The gradients each optimiser step takes, by parameter: a pre-hook on every optimiser of the
    Trainable (an OptimizerGroup's each) notes each gradient's identity and version as the step begins,
    no kernel and no copy, so the timed step pays next to nothing. After the step they are summed only if
    still the same: the gradients after reduction, as the optimiser read them."""

    def __init__(self, optimizer):
        self.stepped: dict[int, tuple[int, int]] = {}
        # base.OptimizerGroup (a layer above) holds several in `optimizers`; a loop of its own may have none
        each = getattr(optimizer, "optimizers", {"": optimizer}).values() if optimizer is not None else []
        self.handles = [o.register_step_pre_hook(self._note) for o in each if isinstance(o, torch.optim.Optimizer)]

    def _note(self, optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            self.stepped.update((id(p), _mark(p.grad)) for p in group["params"] if p.grad is not None)

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def compare(gathered: list[list[tuple]], step: int) -> str | None:
    """The first disagreement among every rank's checksums (gathered[r]: rank r's), as one line: the step,
    the tensor (in the order of the lowest rank that holds it) and the first two ranks that differ, or a
    rank that lacks what its peers hold (a gradient one of them never made); None when all agree."""
    held: dict[tuple[str, tuple], dict[int, tuple]] = {}
    for rank, entries in enumerate(gathered):
        for name, group, value in entries:
            held.setdefault((name, tuple(group)), {})[rank] = value
    for (name, group), values in held.items():
        ranks = sorted(values)
        if missing := [r for r in group if r not in values]:
            return f"replicas part at step {step}: {name} is on rank {ranks[0]} but not on rank {missing[0]}"
        if (other := next((r for r in ranks if values[r] != values[ranks[0]]), None)) is not None:
            what = "loss" if name == "loss" else "replica"
            return (f"replicas part at step {step}: {name} differs between rank {ranks[0]} and rank {other} "
                    f"(they should hold the same {what})")
    return None


class Check:
    """The loop's per-step check (--check-replicas): `found` keeps the first disagreement, `checked` counts
    the steps in which something was compared (None: no check). After the first disagreement no more are
    compared (every rank sees the same gathered sums, so all stop together): the run goes on to the
    oracle's verdict. Nothing where the flag is off or the run has one process (an in-process strategy
    drives every device from one, with no copy to compare)."""

    def __init__(self, config, dims, dist, trainable):
        self.on = bool(config.check_replicas) and dist.world_size == dims.world > 1 and td.is_initialized() \
            and trainable is not None
        self.dims, self.rank, self.world, self.trainable = dims, dist.rank, dist.world_size, trainable
        self.found, self.checked = "", 0 if self.on else None
        self.grads = Gradients(trainable.optimizer) if self.on else None

    def after(self, step: int, loss: torch.Tensor) -> None:
        if not self.on or self.found:
            return
        every: list = [None] * self.world
        td.all_gather_object(every, checksums(self.trainable, loss, self.dims, self.rank, self.grads.stepped))
        self.grads.stepped.clear()
        self.checked += any(every)  # a step counts where some ranks share something (not FSDP's shards alone)
        self.found = compare(every, step) or ""
        if self.found:
            self.close()

    def close(self) -> None:
        """The optimisers' hooks off: after the first difference, and at the loop's end."""
        if self.grads is not None:
            self.grads.close()
