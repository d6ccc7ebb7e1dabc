"""Hyperparameter sweeps in the style of a RunManager: every combination of the given values, one
training run each, each logged to TensorBoard (scalars and hparams), one table at the end.

    python -m parallel sweep --lr 0.01,0.001 --batch-size 1000,10000 --num-workers 0,1 --device cpu,cuda
                             [--workload cnn] [--steps 20] [--warmup 3] [--seed 0] [--out DIR]

Each run is `single` through THE training loop (parallel/loop/train.py), fed by a torch DataLoader with
`--num-workers` loader processes over the same synthetic data and the same batches as every other command.
A device that is not here (cuda on a machine without one) is skipped with a note. Writes
OUT/sweep.json and OUT/sweep.csv (rewritten after every run) and OUT/tb/<run>/ for TensorBoard.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from collections import OrderedDict
from pathlib import Path

from rich.markup import escape
from torch.utils.data import DataLoader, Dataset

from parallel import strategies
from parallel.basics import implausible
from parallel.config import RunConfig
from parallel.loop.results import atomic_write, prepare_out
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS, accuracy, eval_loss
from parallel.style.terminal import make_progress
from parallel.worker import execute
from parallel.world.devices import gpu_count
from parallel.world.dist import Dist
from parallel.world.errors import ConfigError

GRID = OrderedDict(lr=float, batch_size=int, num_workers=int, device=str)  # the swept knobs, in table order


def runs(grid: dict[str, list]) -> list[dict]:
    """Every combination, in order (the RunBuilder of the RunManager pattern)."""
    return [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]


def parse_grid(args) -> dict[str, list]:
    grid = {}
    for name, kind in GRID.items():
        text = str(getattr(args, name))
        if name == "lr" and getattr(args, name) is None:  # the workload's optimiser's own (loop/optim.DEFAULTS)
            text = str(RunConfig(workload=args.workload).validate().lr)
        try:
            values = [kind(v.strip()) for v in text.split(",") if v.strip()]
        except ValueError:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} {text!r}: expected a comma list of {kind.__name__}") from None
        if not values:
            raise ConfigError(f"--{name.replace('_', '-')} is empty")
        grid[name] = list(dict.fromkeys(values))
    for w in grid["num_workers"]:
        if w < 0:
            raise ConfigError(f"--num-workers must be 0 or more, got {w}")
    for d in grid["device"]:
        if d != "cpu" and not (d == "cuda" or d.startswith("cuda:")):
            raise ConfigError(f"--device {d!r}: expected cpu, cuda or cuda:N")
    return grid


def config_for(point: dict, base: RunConfig) -> RunConfig:
    device = "cpu:1" if point["device"] == "cpu" else ("cuda:0" if point["device"] == "cuda" else point["device"])
    return dataclasses.replace(base, lr=point["lr"], batch_size=point["batch_size"], devices=device,
                               world_size=0).validate()


def unavailable(device: str) -> str | None:
    if device == "cpu":
        return None
    index = int(device.partition(":")[2] or 0)
    if not gpu_count():
        return "no CUDA device here"
    if index >= gpu_count():
        return f"only {gpu_count()} CUDA device(s) here"
    return None


class _Steps(Dataset):
    """Item `step` = SyntheticData.batch(step), made in the loader's processes: a sweep run sees exactly the
    batches every other command sees (token batches are drawn per step, so there are no samples to index)."""

    def __init__(self, data: SyntheticData, steps: int):
        self.data, self.steps = data, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, step: int):
        return self.data.batch(step)


class LoaderData:
    """THE loop's data source (`batch(step, rank, world)`), served by a DataLoader in step order."""

    def __init__(self, data: SyntheticData, steps: int, num_workers: int, pin_memory: bool, timeout: float):
        # batch_size=None: each item is already a whole batch; the loader's processes make them ahead
        self.loader = DataLoader(_Steps(data, steps), batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                                 timeout=timeout if num_workers else 0)  # a stuck loader process fails, not hangs
        self._it, self._next = iter(self.loader), 0
        self.asked: list[float] = []  # perf_counter at every request: consecutive ones are loading + a step

    def batch(self, step: int, rank: int = 0, world_size: int = 1):
        if step != self._next or world_size != 1:
            raise RuntimeError(f"the sweep's loader serves steps in order to one process; asked for step {step}")
        self._next += 1
        self.asked.append(time.perf_counter())
        return next(self._it)

    def step_ms_end_to_end(self, skip: int) -> float | None:
        """Median time from one step's request for data to the next's, after `skip` warm-up steps."""
        gaps = [b - a for a, b in itertools.pairwise(self.asked[skip:])]
        return statistics.median(gaps) * 1e3 if gaps else None

    def close(self) -> None:
        del self._it  # shuts the loader processes down


def run_point(point: dict, config: RunConfig) -> dict:
    """One training run; the row of the sweep table."""
    workload = WORKLOADS[config.workload]
    device = config.spec.device(0)
    data = LoaderData(SyntheticData(workload, config.seed, config.batch_size), config.warmup + config.steps,
                      point["num_workers"], pin_memory=device.type == "cuda", timeout=config.timeout)
    start, watch = time.perf_counter(), implausible.Watch()
    try:
        row, state = execute(strategies.get("single"), config, Dist(device=device), data=data)
    finally:
        data.close()  # the loader processes reaped, so their CPU time counts as this run's, not others'
    wall, others = time.perf_counter() - start, watch.stop()
    end_to_end = data.step_ms_end_to_end(config.warmup)
    return {**point, "status": "ok", "final_loss": row.final_loss, "eval_loss": eval_loss(workload, state, config.seed),
            "eval_accuracy": accuracy(workload, state, config.seed), "step_ms_p50": row.step_ms_p50,
            "step_ms_end_to_end": end_to_end,  # the loop's clock is around the step; this includes loading
            "samples_per_s_end_to_end": config.batch_size / end_to_end * 1e3 if end_to_end else None,
            "wall_s": wall, "others_cpu": others, "losses": row.losses, "step_ms": row.step_ms}


def run_name(point: dict) -> str:
    return f"lr={point['lr']:g}_bs={point['batch_size']}_workers={point['num_workers']}_{point['device']}"


def log_run(tb: Path, result: dict) -> None:
    """One TensorBoard run per grid point: the loss and step time per step, and the hparams with their
    final metrics (TensorBoard's HPARAMS tab compares the runs)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(str(tb / run_name(result))) as w:
        for step, loss in enumerate(result.get("losses", [])):
            w.add_scalar("loss/train", loss, step)
        for i, ms in enumerate(result.get("step_ms", [])):
            w.add_scalar("step_time_ms", ms, i)
        metrics = {f"hparam/{k}": result[k] for k in ("final_loss", "eval_loss", "eval_accuracy",
                                                       "samples_per_s_end_to_end")
                   if isinstance(result.get(k), float)}
        w.add_hparams({k: result[k] for k in GRID}, metrics, run_name=".")  # ".": this run's own folder


COLUMNS = [("lr", "lr", "{:g}"), ("batch_size", "batch", "{:,}"), ("num_workers", "workers", "{}"),
           ("device", "device", "{}"), ("final_loss", "loss", "{:.4f}"), ("eval_loss", "eval loss", "{:.4f}"),
           ("eval_accuracy", "eval acc.", "{:.1%}"), ("step_ms_p50", "step ms", "{:.1f}"),
           ("step_ms_end_to_end", "step+load ms", "{:.1f}"), ("samples_per_s_end_to_end", "samples/s", "{:,.0f}"),
           ("wall_s", "wall s", "{:.1f}"), ("status", "status", "{}")]


def flag_timings(results: list[dict]) -> None:
    """r["noisy"]: why a run's timings cannot be right as measured (basics/implausible.py), "" when nothing says so.
    Beside each run's own spread and the CPU other processes used, the physics: step+load includes the step,
    and runs that differ only in lr do the same work, so their steps cannot differ twofold."""
    timed = [(i, r) for i, r in enumerate(results, 1) if r.get("status") == "ok" and r.get("step_ms_p50")]
    for r in results:
        step, ms = r.get("step_ms_p50"), r.get("step_ms") or []
        if r.get("status") != "ok" or not step:
            r["noisy"] = ""
            continue
        flags = [implausible.spread({"p50_ms": step, "min_ms": min(ms), "n": len(ms)}) if ms else None,
                 implausible.busy(r.get("others_cpu"))]
        both = r.get("step_ms_end_to_end")
        if both and both * implausible.FASTER < step:
            flags.append(f"step+load {both:.3g} ms is less than the step alone ({step:.3g} ms), which cannot be: "
                         "it includes the step")
        same = [(i, o["step_ms_p50"]) for i, o in timed
                if o is not r and all(o[k] == r[k] for k in ("batch_size", "num_workers", "device"))]
        if same:
            i, other = max(same, key=lambda x: max(x[1] / step, step / x[1]))
            if max(other / step, step / other) > 2:
                flags.append(f"the same step took {other:.3g} ms in run #{i}, which cannot be: only lr differs, "
                             "and it does not change the work")
        r["noisy"] = "; ".join(f for f in flags if f)


def table(results: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    t.add_column("#", justify="right")
    for _, header, _ in COLUMNS:
        t.add_column(header, justify="left" if header in ("device", "status") else "right", overflow="fold")
    for i, r in enumerate(results, 1):
        cells = {k: "-" if r.get(k) is None else escape(fmt.format(r[k])) for k, _, fmt in COLUMNS}
        cells["step_ms_p50"] = implausible.mark(cells["step_ms_p50"], bool(r.get("noisy")))
        t.add_row(str(i), *cells.values())
    return t


def save(out: Path, base: RunConfig, results: list[dict], skipped: list[str]) -> None:
    """sweep.json (everything, per-step lists included) and sweep.csv (one row per run), atomically."""
    import csv
    import io
    import json


    doc = {"config": dataclasses.asdict(base), "runs": results, "skipped": skipped}
    atomic_write(out / "sweep.json", json.dumps(doc, indent=2))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=[k for k, _, _ in COLUMNS] + ["noisy", "error"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(results)
    atomic_write(out / "sweep.csv", buf.getvalue())


def main(args, console) -> int:
    grid = parse_grid(args)
    base = RunConfig(workload=args.workload, steps=args.steps, warmup=args.warmup, seed=args.seed,
                     timeout=args.timeout).validate()
    if base.workload not in WORKLOADS or WORKLOADS[base.workload].multi_part:
        raise ConfigError(f"the sweep trains one model with one optimiser; {base.workload} has several")
    points, skipped = [], {}
    for point in runs(grid):
        why = unavailable(point["device"])
        if why:
            skipped[point["device"]] = (why, skipped.get(point["device"], (why, 0))[1] + 1)
            continue
        config_for(point, base)  # every run's config checked before the first one starts
        points.append(point)
    skipped = [f"{device}: {n} run(s) skipped, {why}" for device, (why, n) in skipped.items()]
    if not points:  # refused like bad input: nothing written, no table of nothing
        raise ConfigError(f"the sweep has nothing to run: {'; '.join(skipped)}")
    out = Path(args.out or Path("results") / time.strftime("sweep-%Y%m%d-%H%M%S"))
    prepare_out(out)
    results: list[dict] = []
    with make_progress(console) as progress:
        task = progress.add_task("sweep", total=len(points))
        try:
            for point in points:
                progress.update(task, description=run_name(point))
                try:
                    result = run_point(point, config_for(point, base))
                except Exception as e:  # one failed run is a row of the table, not the end of the sweep
                    result = {**point, "status": "failed", "error": f"{type(e).__name__}: {e}".splitlines()[0]}
                results.append(result)
                flag_timings(results)
                log_run(out / "tb", result)
                save(out, base, results, skipped)
                progress.advance(task)
        except KeyboardInterrupt:
            done = f"the {len(results)} finished run(s) are in {out}/sweep.json" if results else "no run had finished"
            console.print(f"[bold red]interrupted[/]: {escape(done)}")
            return 130
    console.print(table(results, f"sweep: {base.workload}, {base.steps} timed steps after {base.warmup} warm-up, "
                                 f"seed {base.seed}"))
    for line in skipped + [f"{run_name(r)} failed: {r['error']}" for r in results if r.get("error")]:
        console.print(f"- {line}", markup=False, highlight=False)
    for i, r in enumerate(results, 1):
        if r.get("noisy"):
            console.print(f"noisy: #{i} {run_name(r)} step ms: {r['noisy']}; rerun it when the machine is quiet, or "
                          "with more --steps", style="yellow", markup=False, highlight=False)
    console.print("step ms: the loop's synchronized clock around the step. step+load ms: from one step's request "
                  "for data to the next's, so loading shows there (num_workers > 0 loads in other processes).")
    console.print(f"results: {out}/sweep.json, sweep.csv; TensorBoard: ./launch.sh tensorboard {out}", markup=False,
                  highlight=False)
    return 0 if results and all(r["status"] == "ok" for r in results) else 1


def add_parser(sub) -> None:
    d = RunConfig()
    p = sub.add_parser("sweep", help="a grid of runs (lr x batch size x loader workers x device), RunManager-style")
    p.add_argument("--lr", default=None, metavar="LIST", help="comma list of learning rates (the workload's "
                   "optimiser's: SGD 0.02, AdamW 3e-3 on the transformer)")
    p.add_argument("--batch-size", default=str(d.batch_size), metavar="LIST",
                   help=f"comma list of batch sizes ({d.batch_size})")
    p.add_argument("--num-workers", default="0", metavar="LIST", help="comma list of DataLoader worker processes (0)")
    p.add_argument("--device", default="cpu", metavar="LIST",
                   help="comma list of cpu, cuda, cuda:N (cpu); missing ones are skipped")
    p.add_argument("--workload", default=d.workload, metavar="NAME", help=f"mlp, cnn or transformer ({d.workload})")
    p.add_argument("--steps", type=int, default=d.steps, metavar="N", help=f"timed steps per run ({d.steps})")
    p.add_argument("--warmup", type=int, default=d.warmup, metavar="N", help=f"untimed steps first ({d.warmup})")
    p.add_argument("--seed", type=int, default=d.seed, metavar="N", help=f"seed of weights and data ({d.seed})")
    p.add_argument("--timeout", type=float, default=d.timeout, metavar="SECONDS",
                   help="seconds a loader process may take per batch")
    p.add_argument("--out", default="", metavar="DIR", help="results folder (default results/sweep-<time>)")
