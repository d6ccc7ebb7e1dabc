"""pipeline: model_parallel's stages over m micro-batches, GPipe (Huang et al. 2019) or 1F1B (PipeDream).

    python scripts/pipeline.py --devices cpu:2 [--microbatches 4] [--schedule 1f1b|gpipe]

    gpipe  stage 0:  F1 F2 F3 F4 .  .  .  .  B4 B3 B2 B1     p = 2 stages, m = 4 micro-batches
           stage 1:  .  F1 F2 F3 F4 B4 B3 B2 B1 .  .  .      idle ("bubble") = (p-1)/(m+p-1) = 1/5
    1f1b   stage 0:  F1 F2 .  B1 F3 B2 F4 B3 .  B4           same bubble in theory; at most p micro-
           stage 1:  .  F1 B1 F2 B2 F3 B3 F4 B4 .            batches of activations held, not m

The global batch is cut into m micro-batches. Each stage has its own long-lived thread that runs its
list of F and B operations in order, waiting for its neighbour's activations or gradients: while stage
1 works on micro-batch 1, stage 0 already runs micro-batch 2. On GPUs each stage's kernels go to its own
device's default stream (no extra streams are made: the overlap is between devices, not within one).
Micro-batch j's loss is weighted by its share of the batch, so the gradients the micro-batches
accumulate add up to the gradient of the whole batch and the one optimiser step equals `single`'s.

The theory assumes every stage has the same forward:backward ratio. The CNN's first stage (conv1) is
forward-heavy and its second (conv2's backward) backward-heavy: GPipe then runs its forward phase at
stage 0's pace and its backward phase at stage 1's, and idles more than (p-1)/(m+p-1); 1F1B's steady
state pays F+B per micro-batch on every stage, which balances them.

The defaults, 1F1B over m = 4, are what measured fastest on the default comparison (CNN, cpu:2, batch 512;
speedup over `single` in the same run, two runs): 1f1b m=2 1.06/1.23x, m=4 1.34/1.35x, m=8 1.33/1.29x;
gpipe m=2 1.10/0.96x, m=4 1.01/1.11x, m=8 1.09/1.13x. More micro-batches shrink the bubble but each pays
the per-operation overhead on a smaller batch; GPipe loses to the forward/backward imbalance above. The
cost model plays the chosen schedule out on each stage's own forward and backward times (measure/pipelines.py).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from parallel.kit.primitives import DeviceThreads
from parallel.kit.schedules import SCHEDULES
from parallel.kit.stages import check_layers, stage_backward, stage_forward
from parallel.measure import pipelines
from parallel.strategies.base import Hooks, Mutant, Trainable, injected
from parallel.strategies.model.model_parallel import Options as SplitOptions
from parallel.strategies.model.model_parallel import Stages, model_state_bytes, setup_stages
from parallel.world.errors import ConfigError

NAME = "pipeline"
LAUNCH = "inprocess"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    o = run.options
    m = o.microbatches  # the typed option, from here on the State's
    micro = -(-run.batch_size // m)  # balance the stages at the size they will run
    t = setup_stages(model, make_optimizer, loss_fn, run, micro, o.balance)
    sp = t.state.split
    p = len(sp.stages)
    ops = [SCHEDULES[o.schedule](s, p, m) for s in range(p)]
    if injected(run, MICROBATCH_DROPPED):
        ops = [[op for op in stage if op != ("B", m - 1)] for stage in ops]
    t.state = State(**vars(t.state), m=m, schedule=o.schedule, ops=ops, timeout=run.pg_timeout,
                    pool=DeviceThreads(sp.devices, run.spec.threads_per_device()))
    return t


def train_step(t: Trainable, batch, dist):
    sp, m = t.state.split, t.state.m
    x, y = batch  # the global batch; stage 0 takes it micro-batch by micro-batch
    xs, ys = list(x.chunk(m)), list(y.chunk(m))
    p = len(sp.stages)
    weights = [1 / len(ys)] * len(ys) if injected(t, EQUAL_WEIGHTS) else [len(c) / len(y) for c in ys]
    st = _Step(xs, ys, weights, [queue.SimpleQueue() for _ in range(p)],
               [queue.SimpleQueue() for _ in range(p)], [None] * len(xs), t.state.timeout)
    t.optimizer.zero_grad(set_to_none=True)
    t.state.watch.start_step()
    try:
        t.state.pool.run([lambda s: _run_stage(t, st, s)] * p, list(range(p)))
    except RuntimeError as e:
        raise RuntimeError(f"pipeline stage failed: {type(st.error).__name__}: {st.error}") from e
    sp.sum_tied()  # a weight two stages use (GPT-2's head): its copies' gradients summed (tied.untie)
    t.optimizer.step()
    t.state.watch.end_step()
    return torch.stack(st.losses).sum()


@dataclass
class State(Stages):
    m: int  # micro-batches per step
    schedule: str  # its name: "gpipe" or "1f1b"
    ops: list[list[tuple[str, int]]]  # each stage's schedule: ("F" | "B", micro-batch)
    timeout: float  # seconds a stage waits for its neighbour
    pool: DeviceThreads  # a long-lived thread per stage


@dataclass
class _Step:
    """What the stage threads share during one step."""

    xs: list
    ys: list
    weights: list[float]
    fwd: list  # fwd[s]: activations arriving at stage s
    bwd: list  # bwd[s]: gradients arriving at stage s
    losses: list
    timeout: float
    abort: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def recv(self, q: queue.SimpleQueue):
        """Wait for a neighbour's tensor; give up if another stage failed or after the timeout."""
        deadline = time.monotonic() + self.timeout
        while not self.abort.is_set():
            try:
                return q.get(timeout=0.05)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no tensor from the neighbouring stage in {self.timeout:g} s") from None
        raise RuntimeError("stopped: another stage failed")


def _run_stage(t: Trainable, st: _Step, s: int) -> None:
    """Stage s's operations for one step, in stage s's thread, in its schedule's order."""
    sp, watch = t.state.split, t.state.watch
    stage, device, last = sp.stages[s], sp.devices[s], s == len(sp.stages) - 1
    saved = {}  # micro-batch -> (input, output)
    try:
        for op, j in t.state.ops[s]:
            if op == "F":
                x = st.xs[j] if s == 0 else st.recv(st.fwd[s])
                with watch.forward(s, j):
                    inp, out = stage_forward(stage, x, device, s == 0, watch.meters[s])
                    if last:
                        out = t.loss_fn(out, st.ys[j].to(device)) * st.weights[j]  # sum over j = the batch mean
                        st.losses[j] = out.detach()
                saved[j] = (inp, out)
                if not last:
                    st.fwd[s + 1].put(out.detach())
            else:
                grad = None if last else st.recv(st.bwd[s])
                with watch.backward(s, j):
                    grad = stage_backward(*saved.pop(j), grad)
                if s > 0:
                    st.bwd[s - 1].put(grad)
    except BaseException as e:
        st.error = st.error or e  # the first failure is the cause; the others only stopped
        st.abort.set()
        raise


@dataclass
class Options(SplitOptions):
    microbatches: int = field(default=4, metadata={"help": "micro-batches per step (GPipe's m)"})
    schedule: str = field(default="1f1b", metadata={"help": "1f1b (PipeDream-Flush) or gpipe (all F, then all B)"})

    def __post_init__(self):
        super().__post_init__()
        if self.microbatches < 1:
            raise ConfigError(f"--microbatches must be at least 1, got {self.microbatches}")
        if self.schedule not in self.schedules():
            raise ConfigError(f"--schedule must be one of {', '.join(self.schedules())}, got {self.schedule!r}")

    def schedules(self) -> dict:
        """The schedules this strategy runs, by name."""
        return SCHEDULES


def check(run) -> None:
    check_layers(run)
    if (m := run.options.microbatches) > run.batch_size:
        raise ConfigError(f"--microbatches {m} is more than the global batch {run.batch_size}")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
MICROBATCH_DROPPED = Mutant("pipeline:microbatch-dropped", "the last micro-batch's backward is missing from "
                                                           "every stage's schedule", {"workload": "cnn"})
EQUAL_WEIGHTS = Mutant("pipeline:equal-weights", "micro-batch losses weighted 1/m, not by their size, when the "
                                                 "batch does not divide into m", {"batch_size": 100,
                                                                                  "options": {"microbatches": 3}})
MUTANTS = (MICROBATCH_DROPPED, EQUAL_WEIGHTS)


def defaults(run) -> dict:
    """At least one micro-batch per stage where the user gave no count (fewer leave a stage idle all
    step), up to the batch; the threads' own schedules need nothing more (unequal micro-batches are fine)."""
    m = max(Options.microbatches, run.world_size)
    return {"microbatches": m} if m <= run.batch_size and m != Options.microbatches else {}


def memory_layout(run, layout):
    o = run.options  # a stage a device, and the micro-batches it holds (the planner's memory)
    return layout.replace(pp=layout.dp, dp=1, microbatches=o.microbatches, schedule=o.schedule)


LAYERED = True  # cuts the model's pipeline_layers() into stages

MEASURE = pipelines.Threads()

HOOKS = Hooks(check=check, defaults=defaults, model_state_bytes=model_state_bytes, memory_layout=memory_layout)
