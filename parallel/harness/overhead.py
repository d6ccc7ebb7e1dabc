"""What the harness costs, measured rather than assumed.

    python -m parallel.harness.overhead [--workload cnn] [--batch-size 512] [--steps 40] [--rounds 5]

The median step of `single` run through the harness (`worker.execute`: the one loop, its synchronized
clocks, the strategy interface, the watchdog and checkpoint checks) against a hand-written loop doing
the same SGD steps on the same model, data and threads with nothing around them. The two alternate in
one process, `--rounds` times, so drift of the machine's speed hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from parallel import strategies
from parallel.config import RunConfig
from parallel.dist import Dist
from parallel.train import make_optimizer
from parallel.worker import execute
from parallel.workloads import WORKLOADS, SyntheticData


def bare_loop_ms(config: RunConfig) -> float:
    """Median ms per timed step of the plainest training loop (CPU: no synchronize needed)."""
    torch.set_num_threads(config.spec.threads_per_device())
    workload = WORKLOADS[config.workload]
    model = workload.build_model(config.seed)
    opt = make_optimizer(config)(model.parameters())
    data = SyntheticData(workload, config.seed, config.batch_size)
    times = []
    for step in range(config.warmup + config.steps):
        x, y = data.batch(step)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        workload.loss(model(x), y).backward()
        opt.step()
        if step >= config.warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m parallel.harness.overhead", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", default="cnn")
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    config = RunConfig(workload=args.workload, batch_size=args.batch_size, steps=args.steps, devices="cpu:2").validate()
    single, harness, bare = strategies.get("single"), [], []
    for _ in range(args.rounds):
        harness.append(execute(single, config, Dist())[0].step_ms_p50)
        bare.append(bare_loop_ms(config))
    h, b = statistics.median(harness), statistics.median(bare)
    print(f"{args.workload}, batch {args.batch_size}, {args.rounds} rounds of {args.steps} steps: harness {h:.2f} ms, "
          f"bare loop {b:.2f} ms per step: the harness adds {h / b - 1:+.1%}")


if __name__ == "__main__":
    main()
