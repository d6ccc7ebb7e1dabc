"""hogwild: lock-free asynchronous SGD on parameters in shared memory (Niu, Recht, Re, Wright 2011).

    python scripts/hogwild.py --workers 2 [--workload cnn] [--steps 20] [--out DIR]

    parent:  model.share_memory()  ->  spawn W workers  ->  join  ->  evaluate
    worker r: its own optimiser (momentum kept privately) over the SHARED parameters; at step s it
              takes share r of global batch s, computes a gradient from whatever the parameters are
              at that moment, and writes its update with no lock, while the others do the same.

The diff from `single`: no synchronisation at all. Workers read parameters other workers are halfway
through updating, so the result is not `single`'s (the equivalence verdict is "not-expected"); the
report compares where it converged instead, on the same number of samples. Staleness makes the
asynchrony visible: a shared counter of updates says how many other updates landed between a worker's
read of the parameters and its own write. Gradients are allocated lazily in each worker, so they are
private (pytorch/examples mnist_hogwild); only parameters are shared.
"""

from __future__ import annotations

import resource
import traceback
from dataclasses import dataclass, field

import numpy as np
import torch

from parallel.kit.tensors import param_bytes
from parallel.loop.optim import make_optimizer, moments, tag
from parallel.loop.profiling import make_profiler
from parallel.loop.tokens import loss_of
from parallel.loop.train import TrainResult, default_dtype
from parallel.loop.train import train as the_loop
from parallel.measure import replicas
from parallel.models.outputs import call
from parallel.strategies.base import Hooks, Trainable
from parallel.strategies.base import dims as base_dims
from parallel.world.devices import cpu_cores
from parallel.world.dist import Dist, fresh_processes
from parallel.world.errors import ConfigError

NAME = "hogwild"
LAUNCH = "hogwild"
SYNCHRONOUS = False


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    model.share_memory()  # parameters move to shared memory BEFORE the workers start
    return Trainable(model, None, loss_fn, dist.device, state=State(world_size(run)))


def train_step(t: Trainable, batch, dist):
    """One worker's step: read the shared parameters (version `seen`), compute, write without a lock."""
    counter = t.state.counter
    seen = counter.value  # updates that had landed when this step read the parameters
    x, y = batch  # this worker's share of the global batch, (B/W, ...)
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()
    t.optimizer.step()  # in place on the shared storage, racing the other workers
    with counter.get_lock():  # the counter itself is exact; the parameters are not locked
        counter.value += 1
        t.state.staleness.append(counter.value - seen - 1)
    return loss.detach()


@dataclass
class State:
    workers: int
    counter: object = None  # in a worker: the shared count of updates (a multiprocessing Value)
    begun: object = None  # the steps each worker has begun (a shared Array): the parent's watch of a stall
    staleness: list[int] = field(default_factory=list)  # in a worker: updates landed between read and write
    summary: dict = field(default_factory=dict)  # in the parent: the workers' figures, combined


@dataclass
class Options:
    workers: int = field(default=0, metadata={"help": "worker processes; 0 = one per device"})

    def __post_init__(self):
        if not 0 <= self.workers <= 64:
            raise ConfigError(f"--workers must be 1..64 (0: one per device), got {self.workers}")


def check(run) -> None:
    if run.precision == "bf16-master":
        raise ConfigError("hogwild's workers update one shared copy of the weights in place, without locks; under "
                          "--precision bf16-master each worker's fp32 master would overwrite the others' updates")
    n = world_size(run)
    run.check_divisible(n, "--workers")


def world_size(run) -> int:
    return run.options.workers or run.world_size


def available(spec) -> str | None:
    # CUDA tensors cross processes by IPC and must outlive every consumer; not run here, so refused.
    return "Hogwild here shares CPU memory; CUDA is not supported" if spec.real else None




def train(strategy, t: Trainable, data, run, dist, profiler=None):
    """Spawn the workers, each running THE loop on its shares; combine their clocks and losses."""
    ctx = fresh_processes(shared_tensors=len(t.model.state_dict()))  # no forked thread pools or locks
    workers = t.state.workers
    # The barrier lines the workers up after their (staggered) start-up, so the wall time of the run is
    # time they all trained in; its timeout means a worker that dies early cannot hang the others.
    counter, results, start = ctx.Value("q", 0), ctx.Queue(), ctx.Barrier(workers, timeout=run.pg_timeout)
    begun = ctx.Array("q", workers)
    procs = [ctx.Process(target=_worker, args=(r, t.model, run, (counter, begun), results, start),
                         name=f"hogwild-{r}") for r in range(workers)]
    for p in procs:
        p.start()
    try:
        outs = _collect(procs, results, begun, run.pg_timeout)
    finally:  # a crash or an interrupt leaves no worker behind
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join()
    start, end = min(o.timed[0] for o in outs), max(o.timed[1] for o in outs)
    staleness = np.concatenate([o.staleness for o in outs])
    t.state.summary = {"workers": len(outs), "staleness_mean": float(staleness.mean()),
                          "staleness_p95": float(np.percentile(staleness, 95)), "staleness_max": int(staleness.max()),
                          "timed_wall_s": end - start, "process_peak_rss_per_worker": [o.peak_rss for o in outs]}
    # Aggregate throughput: every timed sample of every worker over the wall time they took together.
    samples = run.steps * run.batch_size  # W workers x steps x B/W
    losses = np.mean([o.losses for o in outs], axis=0).tolist()  # per step, the mean over the workers' shares
    return TrainResult(losses, [s for o in outs for s in o.step_s], (start, end), samples_per_s=samples / (end - start))


def _worker(rank, model, run, shared, results, start) -> None:
    """One Hogwild worker: its own seed, threads, optimiser and shares of the data; then THE loop."""
    try:
        workers = world_size(run)
        torch.manual_seed(run.seed + rank)
        torch.set_num_threads(max(1, cpu_cores() // workers))
        workload = run.workload
        tag(model, workload.classes)  # each worker its own optimiser, its own clip (by its own gradient's norm)
        t = Trainable(model, make_optimizer(run)(model.parameters()), loss_of(workload), torch.device("cpu"),
                      state=State(workers, *shared))
        me = Dist(rank=rank, local_rank=rank, world_size=workers, local_world_size=workers)
        with default_dtype(run):  # the shared model is float64 under --precision fp64: its data too
            data = workload.dataset(run.seed, run.batch_size)
        start.wait()
        with make_profiler(run.profile, run.out, NAME, rank, me.device) as prof:
            result = the_loop(_Me, t, data, run, me, prof)
        result.staleness = t.state.staleness
        result.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
        results.put((rank, None, result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((rank, f"{type(e).__name__}: {e}", traceback.format_exc()))


class _Me:
    """What THE loop needs of the strategy inside a worker."""

    name = NAME
    dims = staticmethod(base_dims)  # W replicas, each its share of every global batch

    @staticmethod
    def train_step(t: Trainable, batch, dist):
        t.state.begun[dist.rank] += 1  # for the parent: which step a worker that stalls or dies was in
        return train_step(t, batch, dist)


def _collect(procs, results, begun, stall_s: float, poll_s: float = 0.25) -> list[dict]:
    """Wait for every worker's result; a worker that fails, dies, or begins no step for `stall_s` (--pg-timeout)
    once the steps have begun, makes the run fail, naming it and its step."""
    import queue
    import time

    outs: dict[int, dict] = {}
    seen, since = list(begun), time.monotonic()
    while len(outs) < len(procs):
        try:
            rank, error, payload = results.get(timeout=poll_s)
        except queue.Empty:
            left = [r for r in range(len(procs)) if r not in outs]
            if seen != list(begun) or not any(seen):
                seen, since = list(begun), time.monotonic()
            where = {r: f"in its step {begun[r] - 1}" if begun[r] else "before its first step" for r in left}
            if dead := [r for r in left if not procs[r].is_alive() and procs[r].exitcode]:
                raise RuntimeError(f"hogwild worker {dead[0]} died {where[dead[0]]} (exit code "
                                   f"{procs[dead[0]].exitcode})") from None
            if time.monotonic() - since > stall_s:
                raise RuntimeError(f"hogwild worker {left[0]} stalled {where[left[0]]}: no worker began a step for "
                                   f"{stall_s:g} s (--pg-timeout); {len(outs)} of {len(procs)} had finished") from None
            continue
        if error:
            raise RuntimeError(f"hogwild worker {rank} failed: {error}")
        outs[rank] = payload
    return [outs[r] for r in range(len(procs))]


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}






def model_state_bytes(t: Trainable, run) -> list[int]:
    """The parameters once, in shared memory (counted with worker 0); each worker's own gradients and
    optimiser state (SGD's momentum: one buffer; AdamW's two moments) in that worker."""
    params = param_bytes(t.model.parameters())
    per_worker = params * (1 + moments(run, t.model.parameters()))
    return [params + per_worker] + [per_worker] * (t.state.workers - 1)


def memory_layout(run, layout) -> None:
    return None  # a process a replica, all updating one shared model: no layout the planner has


NOT_EXPECTED_REASON = "asynchronous: workers update shared parameters without locks, in no fixed order"
CHECKPOINTS = False  # each worker's optimiser state lives and dies in that worker

# Its measurement (parallel/measure/replicas.py): nothing sent, a worker's step predicted, what the workers saw.
MEASURE = replicas.Workers(world_size, summary=lambda t: t.state.summary)

HOOKS = Hooks(world_size=world_size, available=available, check=check, train=train, state_dict=state_dict,
              model_state_bytes=model_state_bytes, memory_layout=memory_layout)
