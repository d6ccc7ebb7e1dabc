"""`python -m parallel bench cpu-vs-gpu | streams | memory`, and the memory tables of `devices`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch
from rich.markup import escape
from rich.table import Table

from parallel.basics import bench, implausible, savers
from parallel.basics import memory as mem
from parallel.basics import streams as st
from parallel.loop.results import atomic_write, prepare_out
from parallel.world.devices import activate, gpu_count
from parallel.world.devicespec import parse_devices
from parallel.world.errors import ConfigError

MiB = 2**20


def add_parser(sub) -> None:
    bench = sub.add_parser("bench", help="GPU basics: timing CPU vs GPU right, streams, memory savers")
    kinds = bench.add_subparsers(dest="bench", required=True, parser_class=type(bench), metavar="KIND")
    cvg = kinds.add_parser("cpu-vs-gpu", help="each case timed synchronized and naively, on CPU and GPU")
    cvg.add_argument("--scale", type=float, default=1.0, metavar="FACTOR",
                     help="problem size; 1 = the source material's (1)")
    cvg.add_argument("--repeats", type=int, default=10, metavar="N",
                     help="timed repeats per case, after 2 warm-up (10)")
    st = kinds.add_parser("streams", help="a stream race and its two fixes (CUDA)")
    st.add_argument("--trials", type=int, default=20, metavar="N", help="runs of each version (20)")
    mem = kinds.add_parser("memory", help="mixed precision, activation checkpointing, largest batch in a budget")
    mem.add_argument("--workload", default="transformer", metavar="NAME", help="mlp, cnn or transformer (transformer)")
    mem.add_argument("--batch-size", type=int, default=128, metavar="N", help="batch for speed and memory (128)")
    mem.add_argument("--budget-mb", type=float, default=256, metavar="MB",
                     help="memory budget for the largest-batch search, MiB; 0: no search (256)")
    mem.add_argument("--device", default="auto", metavar="DEVICE",
                     help="auto (cuda:0 if there is one), cpu, or cuda:N")
    for p in (cvg, st, mem):
        p.add_argument("--out", default="", metavar="DIR",
                       help="also write the results as JSON to DIR/bench-<kind>.json")


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
        console.print(f"results: {args.out}/bench-{args.bench}.json", markup=False, highlight=False)
    return 0


def _ms(stats: dict) -> str:
    return f"{stats['p50_ms']:.3f} ({stats['min_ms']:.3f} - {stats['max_ms']:.3f})"  # spaces: it can wrap


CPU_SIDE = ("cpu", "numpy (cpu)")  # devices whose ops finish before they return: both clocks time the same work


def line_flags(line: bench.Line) -> list[str]:
    """Why a cpu-vs-gpu line's timings cannot be right as measured (implausible.py); empty when nothing says so."""
    synced, naive = line.synced["p50_ms"], line.naive["p50_ms"]
    flags = [implausible.spread(line.synced), implausible.busy(line.others_cpu)]
    if line.device in CPU_SIDE:
        if synced and naive and not 0.5 <= naive / synced <= 2:
            flags.append(f"naive {naive:.3g} ms against synchronized {synced:.3g} ms, which cannot be: on the CPU "
                         "both clocks time the same finished work")
    elif synced and naive and naive > 1.5 * synced:  # asynchronous: the naive clock sees the queueing only
        flags.append(f"naive {naive:.3g} ms against synchronized {synced:.3g} ms, which cannot be: the synchronized "
                     "clock waits for the work that the naive one only queues")
    return [f for f in flags if f]


def cpu_vs_gpu(args, console) -> dict:
    with console.status("timing") as status:
        watch = implausible.Watch()
        lines = bench.run(args.scale, args.repeats, progress=lambda s: status.update(f"timing {s}"))
    cpu, flagged, rows = {}, _whole(watch), []
    for line in lines:
        synced, naive = line.synced["p50_ms"], line.naive["p50_ms"]
        if flags := line_flags(line):
            flagged[f"{line.case} on {line.device}"] = "; ".join(flags)
        versus = ""
        if line.device in CPU_SIDE:
            cpu[line.case] = synced
        elif line.case in cpu:
            versus = f"{cpu[line.case] / synced:.1f}x / {cpu[line.case] / naive:.1f}x"
        rows.append([escape(line.case), escape(line.device), implausible.mark(_ms(line.synced), bool(flags)),
                     f"{naive:.3f}", f"{naive / synced:.2f}", versus])
    console.print(_table(f"CPU vs GPU, median ms of {args.repeats} (range), after 2 warm-up runs",
                         ["case", "device", "synchronized", "naive (no sync)", "naive / synced",
                          "vs cpu: synced / naive"], rows, left=2, keep=1))
    console.print("synchronized: the device is synchronized before both clock reads, so the time is the work. naive: "
                  "the clock is read right after the call returns, which for asynchronous work (GPU, the simulated "
                  "device) is when it was queued, not done: see the simulated row, whose steps take a known time.")
    _show_flags(console, flagged, "rerun with more --repeats when the machine is quiet")
    if not gpu_count():
        console.print("[yellow]GPU side not run: no CUDA device here (torch.cuda.is_available() is False).[/]")
    console.print(bench.cupy_status(), markup=False)
    return {"scale": args.scale, "repeats": args.repeats, "lines": [dataclasses.asdict(x) for x in lines],
            "noisy": flagged}


def _table(title: str, headers: list[str], rows: list[list[str]], left: int, keep: int) -> Table:
    """The first `left` columns left-aligned, the rest right-aligned; column `keep` is never wrapped or cut
    short (a narrow terminal shrinks the others)."""
    t = Table(title=title, title_justify="left")
    for i, header in enumerate(headers):
        t.add_column(header, justify="left" if i < left else "right", no_wrap=i == keep, overflow="fold")
    for row in rows:
        t.add_row(*row)
    return t


def _whole(watch: implausible.Watch) -> dict[str, str]:
    """{"every figure": why} when other processes were busy over the whole bench, else {}."""
    why = implausible.busy(watch.stop())
    return {"every figure": why} if why else {}


def _show_flags(console, flagged: dict[str, str], todo: str) -> None:
    """One line per flagged figure: what, why it cannot be right as measured, and what to do."""
    for what, why in flagged.items():
        console.print(f"noisy: {what}: {why}; {todo}", style="yellow", markup=False, highlight=False)


def streams(args, console) -> dict:
    if not gpu_count():
        console.print(st.CPU_MESSAGE, markup=False)
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


def memory_flags(results: list[savers.Result]) -> dict[str, list[str]]:
    """{mode: why its step time cannot be right as measured} (implausible.py), for the modes with a reason."""
    by = {r.mode: r for r in results}
    p50 = {mode: r.step_ms["p50_ms"] for mode, r in by.items()}
    flags = {mode: [implausible.spread(r.step_ms), implausible.busy(r.others_cpu)] for mode, r in by.items()}
    recompute = "checkpointing recomputes the forward pass in backward, so its step does more work"
    for mode, than in (("checkpointing", "fp32"), ("both", "autocast")):  # "both": autocast + checkpointing
        if mode in by and than in by:
            flags[mode].append(implausible.cannot_be_faster(p50[mode], p50[than], than, recompute))
    return {mode: [f for f in fs if f] for mode, fs in flags.items() if any(fs)}


def memory(args, console) -> dict:
    device = args.device
    budget = int(args.budget_mb * MiB) or None
    with console.status("measuring") as status:
        watch = implausible.Watch()
        results = savers.run(args.workload, device, args.batch_size, budget, progress=status.update)
    base = results[0]
    flagged = memory_flags(results)
    rows = []
    for r in results:
        largest = "-" if r.largest_batch is None else f"{r.largest_batch:,}"
        speed = implausible.mark(f"{base.step_ms['p50_ms'] / r.step_ms['p50_ms']:.2f}x", r.mode in flagged)
        rows.append([r.mode, r.dtype, _ms(r.step_ms), speed, f"{r.memory_bytes / MiB:.1f}",
                     f"{r.memory_bytes / base.memory_bytes:.2f}x", f"{r.loss_after:.5f}", largest])
    console.print(_table(f"memory savers: {args.workload}, batch {args.batch_size}, {device}",
                         ["mode", "dtype", "step ms (range)", "speed vs fp32", "step memory MiB", "vs fp32",
                          "loss after 5 steps",
                          f"largest batch in {args.budget_mb:g} MiB" if budget else "largest batch"], rows, left=2,
                         keep=0))
    how = ("torch.cuda.max_memory_allocated" if device.type == "cuda" else
           "model state + the peak of the step's allocations (torch.profiler, profile_memory=True)")
    console.print(f"step memory: {how}. checkpointing: {savers.SEGMENTS} segments, recomputed in backward.",
                  markup=False)
    layer = layer_recompute(args.workload, device, args.batch_size)
    if layer:
        console.print(_table("one transformer layer's activations by recomputation (fp32, each storage once)",
                             ["recompute", "measured", "formula", "terms"],
                             [[mode, f"{d['layer_activation_bytes'] / MiB:.2f} MiB",
                               f"{d['layer_activation_predicted'] / MiB:.2f} MiB",
                               ", ".join(f"{k} {v / MiB:.2f}" for k, v in d["layer_activation_terms"].items())]
                              for mode, d in layer.items()], left=1, keep=0))
    noisy = {**_whole(watch), **{f"{mode} step time": "; ".join(why) for mode, why in flagged.items()}}
    _show_flags(console, noisy, "the memory figures stand; rerun for the speeds when the machine is quiet")
    return {"workload": args.workload, "device": str(device), "batch_size": args.batch_size,
            "budget_bytes": budget, "results": [dataclasses.asdict(r) for r in results], "noisy": noisy,
            "layer_recompute": layer}


def layer_recompute(workload: str, device: torch.device, batch: int) -> dict[str, dict]:
    """One block of a token workload, on one batch, without recomputation, with its attention core
    recomputed ("selective") and with all of it ("full"): measured beside activations.formula ({} for
    the workloads without transformer blocks)."""
    from parallel.measure import activations
    from parallel.models.workloads import WORKLOADS

    w = WORKLOADS[workload]
    block = activations.block_of(w.build_model(0)) if w.data == "tokens" else None
    if block is None:
        return {}
    block = block.to(device)
    x = torch.randn(batch, w.input_shape[0], block.norm1.normalized_shape[0], device=device)
    out = {}
    for mode in ("none", "selective", "full"):
        meter = activations.LayerMeter(block)
        block(x)  # the meter keeps this input
        out[mode] = meter.details(w.input_shape[0], "fp32", mode)
    return out


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
    t.add_column("", no_wrap=True)  # the step, whole: "after torch.cuda.empty_cache()"
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
