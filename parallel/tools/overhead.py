"""What the harness costs each strategy, measured rather than assumed.

    python -m parallel.tools.overhead [--strategy ddp,fsdp | all] [--workload cnn] [--steps 30] [--rounds 5]

For each strategy, its median step run through the harness (`worker.execute`: THE loop, with its
monitored barrier before every step on gloo, its synchronized clocks, the profiler and checkpoint hooks
(off), the comm-counting of the warm-up steps) against a bare loop of the same strategy: the strategy's own
`setup` and `train_step` called in a plain `for` with a clock around each step and nothing else. The two
alternate in the same process (the same spawned ranks for the torchrun strategies), `--rounds` times, so
drift of the machine's speed hits both alike; the table gives the median of each and the harness's cost.
`single`'s bare loop is also timed against a hand-written one (no strategy code at all: model, loss,
backward, step), which is what the strategy interface itself costs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from rich.table import Table

from parallel import strategies
from parallel.config import RunConfig
from parallel.launch.ranks import run_ranks
from parallel.loop.optim import make_optimizer, tag
from parallel.models.outputs import call
from parallel.models.transformer import SHAPE
from parallel.models.usermodel import workload_of
from parallel.plan import models as plan_models
from parallel.strategies import BASELINE
from parallel.style.terminal import make_console
from parallel.worker import devices_driven, execute
from parallel.world.devices import synchronizer_all
from parallel.world.dist import Dist


def bare_loop_ms(config: RunConfig) -> float:
    """Median ms per timed step of the plainest training loop (CPU: no synchronize needed)."""
    torch.set_num_threads(config.spec.threads_per_device())
    workload = workload_of(config)
    model = workload.build_model(config.seed)
    tag(model, workload.classes)
    opt = make_optimizer(config)(model.parameters())
    data = workload.dataset(config.seed, config.batch_size)
    times = []
    for step in range(config.warmup + config.steps):
        x, y = data.batch(step)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        workload.loss(call(model, x, y), y).backward()
        opt.step()
        if step >= config.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def strategy_loop_ms(strategy, config: RunConfig, dist: Dist) -> float:
    """Median ms per timed step of the strategy's own setup and train_step in a plain loop, this rank."""
    torch.set_num_threads(config.spec.threads_per_device() * len(devices_driven(strategy, config, dist)))
    workload = workload_of(config)
    model = workload.build_model(config.seed)
    tag(model, workload.classes)
    t = strategy.setup(model, make_optimizer(config), workload.loss, dist, config)
    data = workload.dataset(config.seed, config.batch_size)
    share = strategy.dims(config, dist).batch_share(dist.rank)
    sync = synchronizer_all(t.all_devices())
    times = []
    for step in range(config.warmup + config.steps):
        batch = data.batch(step, *share)
        sync()
        start = time.perf_counter()
        strategy.train_step(t, batch, dist)
        sync()
        if step >= config.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _alternate(strategy, config: RunConfig, dist: Dist, rounds: int) -> tuple[list[float], ...]:
    """Each round: the harness, the strategy's own loop and (for `single`) the hand-written loop, in turn."""
    harness, bare, hand = [], [], []
    for _ in range(rounds):
        harness.append(execute(strategy, config, dist)[0].step_ms_p50)
        bare.append(strategy_loop_ms(strategy, config, dist))
        if strategy.name == BASELINE:
            hand.append(bare_loop_ms(config))
    return harness, bare, hand


def _ranks(rank: int, world: int, name: str, config: RunConfig, rounds: int):
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    return _alternate(strategies.get(name), config, dist, rounds)


def measure(name: str, config: RunConfig, rounds: int) -> tuple[list[float], ...]:
    """Per round, ms a step: the harness, the strategy's bare loop, and (single) the hand-written loop."""
    s = strategies.get(name)
    if s.launch == "torchrun":
        return run_ranks(_ranks, s.world_size(config), (name, config, rounds), timeout=config.pg_timeout,
                         total=60 + 30 * rounds)[0]
    return _alternate(s, config, Dist(), rounds)


def _spread(ms: list[float]) -> str:
    return f"{statistics.median(ms):.2f} [{min(ms):.2f}-{max(ms):.2f}]"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="all", help="comma list or all (the synchronous ones that run here)")
    p.add_argument("--workload", default="cnn")
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--vocab", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=0)
    plan_models.add_shape_arguments(p)  # the transformer at a real size: --preset gpt2-small --layers 2
    args = p.parse_args(argv)
    shape = plan_models.with_preset({k: getattr(args, k) for k in ("preset", "vocab", "seq_len", *SHAPE)})
    workload = "transformer" if any(shape.values()) else args.workload
    config = RunConfig(workload=workload, **shape, batch_size=args.batch_size, steps=args.steps, warmup=args.warmup,
                       devices=args.devices, extras=False).validate()
    names = strategies.NAMES if args.strategy == "all" else args.strategy.split(",")
    workload = workload_of(config)
    runnable = [s.name for s in map(strategies.get, names)
                if s.synchronous and not s.unsupported(workload) and not s.available(config.spec)]
    what = workload.description if any(shape.values()) else args.workload
    table = Table(title=f"The harness against a bare loop of each strategy: {what}, batch {args.batch_size}, "
                        f"{args.devices}, {args.rounds} alternating rounds of {args.steps} steps (median, min-max)",
                  title_justify="left")
    for col in ("strategy", "harness ms", "bare loop ms", "harness adds"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    single = None
    for name in runnable:
        strategies.get(name).validate(config)
        h, b, hand = measure(name, config, args.rounds)
        single = (h, hand) if hand else single
        adds = statistics.median(x / y for x, y in zip(h, b, strict=True)) - 1
        table.add_row(name, _spread(h), _spread(b), f"{adds:+.1%}")
    make_console().print(table)
    if single:  # the same rounds, so the ratio is paired round by round
        h, hand = single
        print(f"a hand-written loop (model, loss, backward, step; no strategy code): {_spread(hand)} ms a step; "
              f"`single` through the harness against it, paired by round: "
              f"{statistics.median(x / y for x, y in zip(h, hand, strict=True)) - 1:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
