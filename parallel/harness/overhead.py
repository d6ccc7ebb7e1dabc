"""What the harness costs each strategy, measured rather than assumed.

    python -m parallel.harness.overhead [--strategy ddp,fsdp | all] [--workload cnn] [--steps 30] [--rounds 5]

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
from parallel.devices import synchronizer_all
from parallel.dist import Dist
from parallel.harness.ranks import run_ranks
from parallel.harness.report import make_console
from parallel.outputs import call
from parallel.train import make_optimizer
from parallel.usermodel import workload_of
from parallel.worker import devices_driven, execute


def bare_loop_ms(config: RunConfig) -> float:
    """Median ms per timed step of the plainest training loop (CPU: no synchronize needed)."""
    torch.set_num_threads(config.spec.threads_per_device())
    workload = workload_of(config)
    model = workload.build_model(config.seed)
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
    t = strategy.setup(workload.build_model(config.seed), make_optimizer(config), workload.loss, dist, config)
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


def _alternate(strategy, config: RunConfig, dist: Dist, rounds: int) -> tuple[list[float], list[float]]:
    harness, bare = [], []
    for _ in range(rounds):
        harness.append(execute(strategy, config, dist)[0].step_ms_p50)
        bare.append(strategy_loop_ms(strategy, config, dist))
    return harness, bare


def _ranks(rank: int, world: int, name: str, config: RunConfig, rounds: int):
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    return _alternate(strategies.get(name), config, dist, rounds)


def measure(name: str, config: RunConfig, rounds: int) -> tuple[float, float]:
    """(harness median ms, bare-loop median ms) of one strategy, alternating `rounds` times."""
    s = strategies.get(name)
    if s.launch == "torchrun":
        harness, bare = run_ranks(_ranks, s.world_size(config), (name, config, rounds), timeout=config.pg_timeout,
                                  total=60 + 30 * rounds)[0]
    else:
        harness, bare = _alternate(s, config, Dist(), rounds)
    return statistics.median(harness), statistics.median(bare)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.harness.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="all", help="comma list or all (the synchronous ones that run here)")
    p.add_argument("--workload", default="cnn")
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    config = RunConfig(workload=args.workload, batch_size=args.batch_size, steps=args.steps, devices=args.devices,
                       extras=False).validate()
    names = strategies.NAMES if args.strategy == "all" else args.strategy.split(",")
    workload = workload_of(config)
    runnable = [s.name for s in map(strategies.get, names)
                if s.synchronous and not s.unsupported(workload) and not s.available(config.spec)]
    table = Table(title=f"The harness against a bare loop of each strategy: {args.workload}, batch "
                        f"{args.batch_size}, {args.devices}, {args.rounds} alternating rounds of {args.steps} steps",
                  title_justify="left")
    for col in ("strategy", "harness ms", "bare loop ms", "harness adds"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name in runnable:
        strategies.get(name).validate(config)
        h, b = measure(name, config, args.rounds)
        table.add_row(name, f"{h:.2f}", f"{b:.2f}", f"{h / b - 1:+.1%}")
    hand = statistics.median(bare_loop_ms(config) for _ in range(args.rounds))
    make_console().print(table)
    print(f"single's own loop against a hand-written one (no strategy code): {hand:.2f} ms per step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
