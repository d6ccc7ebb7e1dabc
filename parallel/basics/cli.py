"""`python -m parallel bench cpu-vs-gpu | streams | memory`, and the memory tables of `devices`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from rich.table import Table

from parallel.basics import bench, savers
from parallel.basics import memory as mem
from parallel.basics import streams as st
from parallel.devices import activate, gpu_count, parse_devices
from parallel.errors import ConfigError
from parallel.results import atomic_write, prepare_out

MiB = 2**20


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="GPU basics: timing CPU vs GPU right, streams, memory savers")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench))
    cvg = kinds.add_parser("cpu-vs-gpu", help="each case timed synchronized and naively, on CPU and GPU")
    cvg.add_argument("--scale", type=float, default=1.0, help="problem size; 1 = the source material's (1)")
    cvg.add_argument("--repeats", type=int, default=10, help="timed repeats per case, after 2 warm-up (10)")
    st = kinds.add_parser("streams", help="a stream race and its two fixes (CUDA)")
    st.add_argument("--trials", type=int, default=20, help="runs of each version (20)")
    mem = kinds.add_parser("memory", help="mixed precision, activation checkpointing, largest batch in a budget")
    mem.add_argument("--workload", default="transformer", help="mlp, cnn or transformer (transformer)")
    mem.add_argument("--batch-size", type=int, default=128, help="batch for speed and memory (128)")
    mem.add_argument("--budget-mb", type=float, default=256, help="memory budget for the largest-batch "
                                                                     "search, MiB; 0: no search (256)")
    mem.add_argument("--device", default="auto", help="auto (cuda:0 if there is one), cpu, or cuda:N")
    for p in (cvg, st, mem):
        p.add_argument("--out", default="", help="also write the results as JSON to OUT/bench-<kind>.json")


def main(args: argparse.Namespace, console) -> int:
    for name in ("repeats", "trials", "batch_size"):
        if getattr(args, name, 1) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "scale", 1.0) <= 0 or getattr(args, "budget_mb", 0) < 0:
        raise ConfigError("--scale must be positive and --budget-mb 0 or more")
    if getattr(args, "workload", "mlp") not in ("mlp", "cnn", "transformer"):
        raise ConfigError(f"--workload for the memory savers: mlp, cnn or transformer, got {args.workload!r}")
    if hasattr(args, "device"):
        args.device = _device(args.device, parse_devices)
    if args.out:
        prepare_out(Path(args.out))
    doc = {"cpu-vs-gpu": cpu_vs_gpu, "streams": streams, "memory": memory}[args.bench](args, console)
    if args.out:
        atomic_write(Path(args.out) / f"bench-{args.bench}.json", json.dumps(doc, indent=2, default=str))
        console.print(f"results: {args.out}/bench-{args.bench}.json")
    return 0


def _ms(stats: dict) -> str:
    return f"{stats['p50_ms']:.3f} ({stats['min_ms']:.3f}-{stats['max_ms']:.3f})"


def cpu_vs_gpu(args, console) -> dict:
    with console.status("timing") as status:
        lines = bench.run(args.scale, args.repeats, progress=lambda s: status.update(f"timing {s}"))
    t = Table(title=f"CPU vs GPU, median ms of {args.repeats} (range), after 2 warm-up runs", title_justify="left")
    for c in ("case", "device", "synchronized", "naive (no sync)", "naive / synced", "vs cpu: synced / naive"):
        t.add_column(c, justify="left" if c in ("case", "device") else "right")
    cpu = {}
    for line in lines:
        synced, naive = line.synced["p50_ms"], line.naive["p50_ms"]
        versus = ""
        if line.device in ("cpu", "numpy (cpu)"):
            cpu[line.case] = synced
        elif line.case in cpu:
            versus = f"{cpu[line.case] / synced:.1f}x / {cpu[line.case] / naive:.1f}x"
        t.add_row(line.case, line.device, _ms(line.synced), f"{naive:.3f}", f"{naive / synced:.2f}", versus)
    console.print(t)
    console.print("synchronized: the device is synchronized before both clock reads, so the time is the work. naive: "
                  "the clock is read right after the call returns, which for asynchronous work (GPU, the simulated "
                  "device) is when it was queued, not done: see the simulated row, whose steps take a known time.")
    if not gpu_count():
        console.print("[yellow]GPU side not run: no CUDA device here (torch.cuda.is_available() is False).[/]")
    console.print(bench.cupy_status())
    return {"scale": args.scale, "repeats": args.repeats, "lines": [dataclasses.asdict(x) for x in lines]}


def streams(args, console) -> dict:
    if not gpu_count():
        console.print(st.CPU_MESSAGE)
        return {"ran": False, "reason": st.CPU_MESSAGE}
    counts = st.check(torch.device("cuda", 0), args.trials)
    t = Table(title=f"x.sum() on a side stream while the default stream writes x: right answers of {args.trials}",
              title_justify="left")
    t.add_column("version")
    t.add_column("right", justify="right")
    for name, right in counts.items():
        t.add_row(name, f"{right}/{args.trials}")
    console.print(t)
    return {"ran": True, "trials": args.trials, "right": counts}


def memory(args, console) -> dict:
    device = args.device
    budget = int(args.budget_mb * MiB) or None
    with console.status("measuring") as status:
        results = savers.run(args.workload, device, args.batch_size, budget, progress=status.update)
    base = results[0]
    t = Table(title=f"memory savers: {args.workload}, batch {args.batch_size}, {device}", title_justify="left")
    for c in ("mode", "dtype", "step ms (range)", "speed vs fp32", "step memory MiB", "vs fp32",
              "loss after 5 steps", f"largest batch in {args.budget_mb:g} MiB" if budget else "largest batch"):
        t.add_column(c, justify="left" if c in ("mode", "dtype") else "right")
    for r in results:
        largest = "-" if r.largest_batch is None else f"{r.largest_batch:,}"
        t.add_row(r.mode, r.dtype, _ms(r.step_ms), f"{base.step_ms['p50_ms'] / r.step_ms['p50_ms']:.2f}x",
                  f"{r.memory_bytes / MiB:.1f}", f"{r.memory_bytes / base.memory_bytes:.2f}x", f"{r.loss_after:.5f}",
                  largest)
    console.print(t)
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
           "model state + the peak of the step's allocations (torch.profiler, profile_memory=True)")
    console.print(f"step memory: {how}. checkpointing: {savers.SEGMENTS} segments, recomputed in backward.")
    return {"workload": args.workload, "device": str(device), "batch_size": args.batch_size,
            "budget_bytes": budget, "results": [dataclasses.asdict(r) for r in results]}


def _device(text: str, parse_devices) -> torch.device:
    if text == "auto":
        return torch.device("cuda", 0) if gpu_count() else torch.device("cpu")
    if text == "cpu":
        return torch.device("cpu")
    spec = parse_devices(text)  # cuda:N: validated (exists, visible) like --devices
    if spec.count != 1:
        raise ConfigError(f"--device takes one device, got {text!r}")
    return spec.device(0)


def memory_table(title: str, rows: list[tuple[str, dict[str, int]]]) -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("")
    for key in rows[0][1]:
        t.add_column(f"{key.replace('_', ' ')} MiB", justify="right")
    for label, figures in rows:
        t.add_row(label, *(f"{v / MiB:,.0f}" for v in figures.values()))
    return t


def show_memory(console) -> None:
    """`devices`: memory per device now, then what freeing and empty_cache do (memory.py)."""
    cuda = [torch.device("cuda", i) for i in range(gpu_count())]
    activate(cuda)  # CUDA initialised before its memory statistics are read
    console.print(memory_table("memory per device", [(str(d), mem.stats(d)) for d in [torch.device("cpu"), *cuda]]))
    device = cuda[0] if cuda else torch.device("cpu")
    console.print(memory_table(f"allocate, free, empty the cache ({device})", mem.empty_cache_demo(device)))
    if not cuda:
        console.print("No CUDA here: torch's caching allocator (reserved memory, empty_cache) is CUDA's. On CPU a "
                      "freed large tensor goes straight back to the system, as the resident memory shows.")
