"""What one step's token batch costs to build at a real size (#44): time, and memory beyond the batch.

    python -m parallel.tools.data_cost [--vocab 128256] [--seq-len 8192] [--batch-size 8] [--runs 7]

Each run is a fresh process: the chain built (V x 4 likely successors, held for the whole run), one toy
batch to load the code paths (numpy's generator, torch's kernels), then one step's global batch at the
size asked (`SyntheticData.batch`), timed with perf_counter, its memory read as the peak RSS during the
build (VmHWM, reset through /proc/self/clear_refs just before) over the RSS before it. RSS rather than
tracemalloc: tracemalloc sees numpy's buffers but not torch's tensors, which hold the tokens. A fresh
process a run, because an allocator that kept the pages of a previous batch would make later ones look
free. The table gives the median and [min-max] over the runs (each run draws another step).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from rich.table import Table

from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS
from parallel.style.terminal import make_console

MB = 2**20


def _kib(field: str) -> int:
    """A Vm* field of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def one(vocab: int, seq_len: int, batch: int, step: int) -> dict:
    """One run, in this process: the chain's build, then batch `step`'s time and memory."""
    SyntheticData(WORKLOADS["transformer"], 0, 2).batch(0)  # the code paths loaded, at the toy size
    workload = dataclasses.replace(WORKLOADS["transformer"], classes=vocab).with_seq_len(seq_len)
    start = time.perf_counter()
    data = SyntheticData(workload, 0, batch)
    chain_s = time.perf_counter() - start
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS now (Linux 4.0+)
    before = _kib("VmRSS")
    start = time.perf_counter()
    x, y = data.batch(step)
    batch_s = time.perf_counter() - start
    return {"chain_s": chain_s, "chain_bytes": data.teacher.nbytes, "batch_s": batch_s,
            "batch_bytes": x.nbytes + y.nbytes, "peak_rise_bytes": _kib("VmHWM") - before}


def measure(vocab: int, seq_len: int, batch: int, runs: int) -> list[dict]:
    """`runs` fresh processes, each `one` at step = its index."""
    out = []
    for step in range(runs):
        cmd = [sys.executable, "-m", "parallel.tools.data_cost", "--one", str(step), "--vocab", str(vocab),
               "--seq-len", str(seq_len), "--batch-size", str(batch)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            raise RuntimeError(f"run {step} failed: {done.stderr.strip().splitlines()[-1:]}")
        out.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return out


def table(runs: list[dict], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("", "median", "min", "max"):
        t.add_column(col, justify="left" if not col else "right")
    rows = [("chain built, s", [r["chain_s"] for r in runs], "{:.3f}"),
            ("chain held, MiB", [r["chain_bytes"] / MB for r in runs], "{:.1f}"),
            ("one batch, ms", [r["batch_s"] * 1e3 for r in runs], "{:.1f}"),
            ("the batch itself (x, y), MiB", [r["batch_bytes"] / MB for r in runs], "{:.2f}"),
            ("peak RSS rise while building, MiB", [r["peak_rise_bytes"] / MB for r in runs], "{:.2f}"),
            ("beyond the batch, MiB", [(r["peak_rise_bytes"] - r["batch_bytes"]) / MB for r in runs], "{:.2f}")]
    for name, values, fmt in rows:
        t.add_row(name, *(fmt.format(v) for v in (statistics.median(values), min(values), max(values))))
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.data_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=128_256, help="tokens in the vocabulary (Llama 3's: 128256)")
    p.add_argument("--seq-len", type=int, default=8192, help="tokens a sequence (8192)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences in the global batch (8)")
    p.add_argument("--runs", type=int, default=7, help="fresh processes, one batch each (7)")
    p.add_argument("--one", type=int, metavar="STEP", help=argparse.SUPPRESS)  # a run's child: prints JSON
    args = p.parse_args(argv)
    if args.one is not None:
        print(json.dumps(one(args.vocab, args.seq_len, args.batch_size, args.one)))
        return 0
    if min(args.vocab - 1, args.seq_len, args.batch_size, args.runs) < 1:
        p.error("--vocab needs at least 2 tokens; --seq-len, --batch-size and --runs at least 1")
    runs = measure(args.vocab, args.seq_len, args.batch_size, args.runs)
    make_console().print(table(runs, f"One step's token batch: vocabulary {args.vocab:,} x {args.seq_len:,} "
                                     f"tokens x batch {args.batch_size}, {args.runs} fresh processes"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
