"""What every optimiser step does around torch's update, the same in every strategy (docs/optimizer.md):

    before optimizer.step()   the global gradient norm, once; the gradients clipped with it (--clip-norm)
    after                     the learning rate to the next step's (--schedule, torch's LambdaLR)
    between                   the update's own time (`update_s`): host clock reads on CPU, CUDA events on
                              GPUs resolved after the step (world/devices.IntervalClock), no synchronize

both as hooks on the strategy's own optimiser (register_step_pre_hook / post_hook), so that no strategy's
train_step changes, and so that every optimiser, torch's ZeroRedundancyOptimizer included, gets them.

The global norm is the norm of the whole model's gradient, one device's, whatever the layout holds:

    norm^2 = all_reduce_sum over ranks ( sum over this rank's gradients g of |g|^2 / copies(g) )

where copies(g) is how many ranks hold that same gradient: every rank for a replica's (DDP), 1 for a
shard (FSDP2, ZeRO's chunks), a stage's parameters (pipelines) or a tensor-parallel slice, tp x dp for a
norm's scale that tensor parallelism leaves whole, the expert group's replicas for an expert. Each
gradient is then counted exactly once. Copies come from the layout's own word: a DTensor's placements,
the rank's coordinates (ParallelDims), or the strategy's `held_by` (divergence.peers, the same rule
--check-replicas compares by). One float64 all-reduce a step, in the counted step; none where every rank
holds the whole gradient (DDP), the norm being its own already. Whether to reduce is agreed by all ranks
once, before the first step: a rank holding only whole copies (a pipeline stage holding only a tied head)
has no share to add, yet the others' all-reduce waits for it. A Partial gradient (a DTensor whose sum
is still spread over ranks) is reduced first: its pieces' norms do not add.

Each gradient's square is summed in float64 (torch.linalg.vector_norm(dtype=float64)), so that the norm
differs between layouts by no more than their gradients do. The clip itself is torch's clip_grads_with_norm_'s
coefficient, min(1, max_norm / (norm + 1e-6)), on each gradient this rank holds."""

from __future__ import annotations

import torch
import torch.distributed as td
from torch.optim.lr_scheduler import LambdaLR

from parallel.loop.divergence import peers
from parallel.world.devices import IntervalClock
from parallel.world.dist import local

NORM_BYTES = 8  # the norm's all-reduce: one float64 a step


class Step:
    """The hooks on every optimiser of a Trainable; `norms()` the pre-clip global norm of every step."""

    def __init__(self, trainable, recipe, dims, dist, clock=None):
        self.recipe, self.trainable = recipe, trainable
        self.clock = clock or IntervalClock([])  # host reads on CPU; CUDA events, resolved after the step
        self.began: dict[str, object] = {}
        self._spans: list[tuple] = []
        self.update_s: dict[str, list[float]] = {}  # each optimiser's update, each step: torch's step alone
        self.together = dist.world_size == dims.world > 1 and td.is_initialized()  # ranks to reduce over
        live = trainable is not None and trainable.optimizer is not None  # none: a test's loop without a model
        names = {id(p): n for n, p in trainable.model.named_parameters()} if live else {}
        # base.OptimizerGroup's several (a layer above), or the one
        each = getattr(trainable.optimizer, "optimizers", {"": trainable.optimizer}) if live else {}
        self.norms_of: dict[str, list[torch.Tensor]] = {k: [] for k in each}
        self.copies: dict[int, int] = {}
        for o in each.values():
            for p in (p for g in o.param_groups for p in g["params"]):
                name = names.get(id(p))  # None: a tensor only the optimiser holds (ZeRO's chunk): this rank's
                held = trainable.held_by.get(name) if name is not None else (dist.rank,)
                copies = trainable.grad_copies.get(id(p)) or len(held or peers(p, dims, dist.rank))
                self.copies[id(p)] = 1 if trainable.clip_alone else copies
        shared = live and not trainable.clip_alone and any(c < dims.world for c in self.copies.values())
        # agreed, once, before the first step: a rank whose gradients are all whole copies (a stage holding
        # only a tied head) has nothing to add, but the others' all-reduce waits for it all the same
        self.reduces = dist.any_rank(shared) if self.together and self.clips else False
        if not self.reduces:  # every rank holds the whole gradient (or the bug says so): its norm is the norm
            self.copies = {i: trainable.grad_copies.get(i, 1) for i in self.copies}  # a tie's copies once
        self.schedules = {k: LambdaLR(o, recipe.factor) for k, o in each.items()}  # each group's lr its base
        for k, o in each.items():
            setattr(o, SCHEDULE, self.schedules[k])
        self.handles = [h for k, o in each.items() for h in (
            o.register_step_pre_hook(lambda opt, args, kwargs, k=k: self._before(k, opt)),
            o.register_step_post_hook(lambda opt, args, kwargs, k=k: self._after(k)))]

    def resume(self, start: int) -> None:
        """After a checkpoint's load: the learning rate of step `start`, from each group's base (LambdaLR's
        own arithmetic, without stepping it before an optimiser step); the schedule's place is the step's."""
        for schedule in self.schedules.values():
            schedule.last_epoch = start
            for group, base in zip(schedule.optimizer.param_groups, schedule.base_lrs, strict=True):
                group["lr"] = base * self.recipe.factor(start)

    @property
    def clips(self) -> bool:
        return self.recipe.clip > 0

    def start_step(self) -> None:
        self.clock.start_step()

    def end_step(self) -> None:
        """After the loop's synchronize at the step's end: each update's span, from its stamps."""
        for key, began, ended in self._spans:
            seconds = self.clock.seconds(ended) - self.clock.seconds(began, first=True)
            self.update_s.setdefault(key, []).append(seconds)
        self._spans = []

    def _after(self, key: str) -> None:
        self._spans.append((key, self.began[key], self.clock.stamp()))  # the update's kernels queued: its end
        self.schedules[key].step()

    def _before(self, key: str, optimizer) -> None:
        self._clip(key, optimizer)
        self.began[key] = self.clock.stamp()  # after the clip's kernels: the update's own start

    def _clip(self, key: str, optimizer) -> None:
        if not self.clips:
            return
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            _reduce_partial(p)
        norm = self.global_norm(params)
        self.norms_of[key].append(norm.detach())
        coef = torch.clamp(self.recipe.clip / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s
        grads = [local(p.grad) for p in params]
        for device, dtype in {(g.device, g.dtype) for g in grads}:
            torch._foreach_mul_([g for g in grads if (g.device, g.dtype) == (device, dtype)], coef.to(device, dtype))

    def global_norm(self, params) -> torch.Tensor:
        """The whole model's gradient norm (float64, on the first gradient's device), each counted once."""
        device = local(params[0].grad).device
        by_copies: dict[int, list[torch.Tensor]] = {}
        for p in params:
            by_copies.setdefault(self.copies[id(p)], []).append(local(p.grad))
        square = torch.zeros((), dtype=torch.float64, device=device)
        for copies, grads in by_copies.items():  # each square summed in float64: a 10^8-element shard's fp32
            #   norm is off by 1e-5 (zero's flat chunks were), 50x the rounding of the gradients themselves
            parts = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64).to(device) for g in grads])
            square = square + (parts * parts).sum() / copies
        if self.reduces:
            square = square.reshape(1)
            td.all_reduce(square)  # (1,) float64: every rank's share of the whole
        return square.reshape(()).sqrt()

    def timed(self, steps: int) -> list[float]:
        """The update's seconds in each of the run's last `steps` steps (the timed ones), optimisers summed."""
        curves = [v[-steps:] for v in self.update_s.values()] if steps else []
        return [sum(c) for c in zip(*curves, strict=True)] if curves else []

    def norms(self) -> dict[str, list[float]]:
        """Each optimiser's pre-clip norm of every step, read after the loop (one wait for the device)."""
        return {k: torch.stack(v).cpu().tolist() for k, v in self.norms_of.items() if v}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


SCHEDULE = "_parallel_schedule"  # the attribute an optimiser's LambdaLR is kept in


def schedule_of(optimizer) -> LambdaLR:
    """The learning-rate schedule the loop's Step gave `optimizer` (the injected bug steps it itself)."""
    return getattr(optimizer, SCHEDULE)


def norm_name(key: str) -> str:
    """How a step's log line, the oracle and the report name an optimiser's norm: grad_norm, or per part."""
    return f"grad_norm {key}" if key else "grad_norm"


def _reduce_partial(p: torch.Tensor) -> None:
    """A DTensor gradient with a Partial placement (its sum spread over ranks) reduced to its placements'
    Replicate, in place of the parameter's gradient: torch's update would reduce it anyway."""
    g = p.grad
    placements = getattr(g, "placements", None)
    if placements is None or not any(pl.is_partial() for pl in placements):
        return
    from torch.distributed.tensor import Replicate

    p.grad = g.redistribute(g.device_mesh, [Replicate() if pl.is_partial() else pl for pl in placements])
