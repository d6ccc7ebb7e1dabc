"""What the always-on record of collectives costs a step, measured in paired rounds.

    python -m parallel.tools.recorder_cost [--strategy ddp,fsdp | all] [--rounds 5] [--steps 20]
    python -m parallel.tools.recorder_cost --detail [--rounds 6]   # one all-reduce: record, DETAIL

The record (recorder.py) is torch's Flight Recorder (on by default; TORCH_FR_BUFFER_SIZE=0, read when a
process makes its first group, turns it off), the loop's marks, and a watch thread. The recorder cannot
be switched off inside a process once its group exists, so each arm is a fresh set of spawned gloo
ranks: one with the record on, as every run has it, one with it off (no Flight Recorder, no marks, no
thread). The arms alternate, and swap their
order every round, so that the machine's drift falls on both; each round gives the ratio of the two
medians of a step, and the table the median of those ratios with their range. The default comparison's
run: the CNN, batch 512, cpu:2, 20 timed steps after 3 warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

from rich.table import Table

from parallel import strategies
from parallel.config import RunConfig
from parallel.launch.ranks import run_ranks
from parallel.loop import recorder
from parallel.models.usermodel import workload_of
from parallel.style.terminal import make_console
from parallel.worker import execute
from parallel.world.dist import Dist


def _rank(rank: int, world: int, name: str, config_json: str, folder: str) -> float:
    config = RunConfig.from_json(config_json)
    with recorder.recording(Path(folder), rank, config.pg_timeout) if folder else contextlib.nullcontext():
        row, _ = execute(strategies.get(name), config, Dist(rank=rank, local_rank=rank, world_size=world,
                                                            local_world_size=world))
    return row.step_ms_p50


@contextlib.contextmanager
def _recorder(on: bool):
    """torch's Flight Recorder on (BUFFER entries) or off for the ranks started inside (they copy this
    process's environment, and torch reads it when their first group is made); as it was after."""
    before = os.environ.get("TORCH_FR_BUFFER_SIZE")
    os.environ["TORCH_FR_BUFFER_SIZE"] = str(recorder.BUFFER) if on else "0"
    try:
        yield
    finally:
        os.environ.pop("TORCH_FR_BUFFER_SIZE", None)
        if before is not None:
            os.environ["TORCH_FR_BUFFER_SIZE"] = before


def one(name: str, config: RunConfig, on: bool) -> float:
    """Median ms a step of one run of `name`, in fresh ranks, with the record on or off (rank 0's)."""
    with _recorder(on), tempfile.TemporaryDirectory(prefix="record-") as folder:
        return run_ranks(_rank, config.world_size, (name, config.to_json(), folder if on else ""),
                         timeout=config.pg_timeout, total=300)[0]


def paired(name: str, config: RunConfig, rounds: int) -> tuple[list[float], list[float]]:
    """(ms on, ms off) per round, the arms' order swapped every round."""
    on, off = [], []
    for r in range(rounds):
        for arm in ((True, False) if r % 2 == 0 else (False, True)):
            (on if arm else off).append(one(name, config, arm))
    return on, off


def _all_reduces(rank: int, world: int, detail: bool, sizes: tuple[int, ...], n: int) -> dict[int, float]:
    """Microseconds an all-reduce of each size takes, in a group made with DETAIL's check or without."""
    import torch
    import torch.distributed as td

    if detail:  # the group made next wraps every collective in torch's fingerprint check
        td.set_debug_level(td.DebugLevel.DETAIL)
    group, out = td.new_group(list(range(world))), {}
    for numel in sizes:
        x = torch.ones(numel)
        for _ in range(20):
            td.all_reduce(x, group=group)
        td.barrier(group=group)
        start = time.perf_counter()
        for _ in range(n):
            td.all_reduce(x, group=group)
        out[numel] = (time.perf_counter() - start) / n * 1e6
    return out


ARMS = ("off", "record", "detail")  # nothing; the record (torch's Flight Recorder); --debug-collectives


def per_collective(rounds: int, sizes: tuple[int, ...] = (1024, 1 << 20), n: int = 200) -> None:
    """--detail: one all-reduce on 2 ranks, with nothing (the Flight Recorder off), with the record, with
    DETAIL's check (the recorder off): fresh ranks for each arm, the arms' order turned every round."""
    arms: dict[str, list[dict]] = {a: [] for a in ARMS}
    for r in range(rounds):
        for arm in ARMS[r % 3:] + ARMS[:r % 3]:
            with _recorder(arm == "record"):
                arms[arm].append(run_ranks(_all_reduces, 2, (arm == "detail", sizes, n), timeout=60, total=300)[0])
    for numel in sizes:
        off = [a[numel] for a in arms["off"]]
        parts = [f"all_reduce of {numel} fp32: {statistics.median(off):.0f} us [{min(off):.0f}-{max(off):.0f}]"]
        for arm in ARMS[1:]:
            us = [a[numel] for a in arms[arm]]
            ratios = [a / b for a, b in zip(us, off, strict=True)]
            parts.append(f"{arm} {statistics.median(us):.0f} us, {statistics.median(ratios):.2f}x "
                         f"[{min(ratios):.2f}-{max(ratios):.2f}]")
        print("; ".join(parts))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.recorder_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="all", help="comma list, or all: every torchrun strategy of the run")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--devices", default="cpu:2")
    p.add_argument("--detail", action="store_true", help="instead: what the record and --debug-collectives "
                   "(torch's TORCH_DISTRIBUTED_DEBUG=DETAIL) cost one all-reduce, 2 ranks")
    args = p.parse_args(argv)
    if args.detail:
        per_collective(args.rounds)
        return 0
    config = RunConfig(devices=args.devices, steps=args.steps, extras=False).validate()
    workload = workload_of(config)
    names = [s.name for s in strategies.all_strategies() if s.launch == "torchrun" and s.synchronous
             and not s.unsupported(workload) and not s.available(config.spec)] \
        if args.strategy == "all" else args.strategy.split(",")
    table = Table(title=f"The record of collectives: a step with it on against off, {config.workload}, batch "
                        f"{config.batch_size}, {args.devices}, {args.rounds} paired rounds (median, min-max)",
                  title_justify="left")
    for col in ("strategy", "on ms", "off ms", "on / off"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for name in names:
        try:
            strategies.get(name).validate(config)
        except Exception:  # noqa: BLE001 (a strategy this run cannot take: fsdp_tp on 2 ranks)
            continue
        on, off = paired(name, config, args.rounds)
        ratios = [a / b for a, b in zip(on, off, strict=True)]
        table.add_row(name, f"{statistics.median(on):.2f}", f"{statistics.median(off):.2f}",
                      f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]")
    make_console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
