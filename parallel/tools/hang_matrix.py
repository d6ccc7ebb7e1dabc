"""A hung rank in every multi-process strategy, at every device count given: does each run end, and what
does its one line say?

    python -m parallel.tools.hang_matrix [--devices cpu:2,cpu:4] [--ranks 0,1] [--how stop|kill]
                                         [--pg-timeout 5] [--only NAMES] [--json FILE]

For each multi-process strategy that runs on the devices (torchrun's, and hogwild's workers), on its
cheapest workload (the CNN, else the MLP, the transformer, the MoE), `python -m parallel run NAME
--hang-rank R --pg-timeout 5 --steps 3` in a fresh process: its wall time, exit status, the row's error
line, whether that line names rank R (worker R) and step 1, whether a traceback reached the terminal, and
whether it says "different collectives" (which it should only where the ranks really issued different
calls). docs/debugging.md's table is this tool's output; the suite runs a cover of it (COVER) in two
comparisons at cpu:4 (tests/test_reliability.py).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from parallel import strategies
from parallel.config import RunConfig
from parallel.loop.results import atomic_write
from parallel.models.workloads import WORKLOADS
from parallel.style.terminal import make_console
from parallel.world.errors import ConfigError

# The suite's cover of the matrix (tests/test_reliability.py): one strategy for each kind of wait a stopped
# rank leaves its peers in, the rest alike to those (each run alone: this tool, docs/measurements.md).
COVER = {
    "stop": {"ddp": "DDP's reducer (its bucket's all-reduce)", "zero_optimizer": "torch's ZeroRedundancyOptimizer",
             "fsdp": "FSDP2's all-gather and reduce-scatter", "tensor_parallel": "DTensor's collectives",
             "hogwild": "workers, no collective", "pipeline_dist": "torch's pipelining, point to point",
             "fsdp_tp": "a 2-D DeviceMesh's groups", "context_parallel": "the ring's point-to-point sends",
             "expert_parallel": "all-to-all"},
    "kill": {"ddp": "the default group", "fsdp_tp": "a 2-D DeviceMesh's groups",
             "pipeline_dist": "point to point", "hogwild": "workers", "ulysses": "all-to-all"},
}


def cases(devices: list[str]) -> list[tuple[str, str, str]]:
    """(strategy, workload, devices) of every multi-process strategy that runs there, on its cheapest workload."""
    out = []
    for d in devices:
        spec = RunConfig(devices=d).validate().spec
        for s in strategies.all_strategies():
            if s.launch == "inprocess" or s.available(spec):
                continue
            workload = next((w for w in ("cnn", "mlp", "transformer", "moe") if not s.unsupported(WORKLOADS[w])), None)
            try:
                s.validate(RunConfig(devices=d, workload=workload, steps=3, batch_size=32).validate())
            except ConfigError:
                continue
            out.append((s.name, workload, d))
    return out


def one(name: str, workload: str, devices: str, rank: int, pg_timeout: float, how: str = "stop") -> dict:
    with tempfile.TemporaryDirectory(prefix="hang-") as out:
        cmd = [sys.executable, "-m", "parallel", "run", name, "--workload", workload, "--devices", devices,
               "--steps", "3", "--batch-size", "32", "--hang-rank", str(rank), "--hang-how", how,
               "--pg-timeout", str(pg_timeout),
               "--timeout", "120", "--out", out]
        start = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        wall = time.monotonic() - start
        rows = json.loads((Path(out) / "results.json").read_text())["rows"] if (Path(out) / "results.json").exists() \
            else []
    error = next((r.get("error") or "" for r in rows if r["strategy"] == name), "")
    named = bool(re.search(rf"\b(rank|worker) {rank}\b", error)) and "step 1" in error
    return {"strategy": name, "workload": workload, "devices": devices, "rank": rank, "how": how,
            "wall_s": round(wall, 1),
            "exit": p.returncode, "named": named, "traceback": "Traceback" in p.stdout + p.stderr,
            "different": "different collectives" in error, "line": error}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.hang_matrix", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", default="cpu:2,cpu:4")
    p.add_argument("--ranks", default="0,1")
    p.add_argument("--pg-timeout", type=float, default=5.0)
    p.add_argument("--how", default="stop", choices=("stop", "kill"), help="the rank stops responding, or is "
                   "killed by SIGKILL (--hang-how)")
    p.add_argument("--only", help="strategies, comma-separated (default: every multi-process one)")
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
        found = cases(args.devices.split(","))
    except (ValueError, ConfigError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.only:
        found = [c for c in found if c[0] in args.only.split(",")]
    console, results = make_console(), []
    for (name, workload, devices) in found:
        for rank in ranks:
            results.append(one(name, workload, devices, rank, args.pg_timeout, args.how))
            r = results[-1]
            console.print(f"{name} {devices} rank {rank}: {r['wall_s']} s, exit {r['exit']}, named {r['named']}")
    t = Table(title=f"--hang-rank R --hang-how {args.how} --pg-timeout {args.pg_timeout:g}: each run's end",
              title_justify="left")
    for col in ("strategy", "devices", "R", "s", "exit", "names R, step 1", "traceback", "different"):
        t.add_column(col)
    for r in results:
        t.add_row(r["strategy"], r["devices"], str(r["rank"]), f"{r['wall_s']:.0f}", str(r["exit"]),
                  "yes" if r["named"] else "NO", "YES" if r["traceback"] else "no", "yes" if r["different"] else "")
    console.print(t)
    if args.json:
        atomic_write(Path(args.json), json.dumps(results, indent=1))
    return 0 if all(r["named"] and r["exit"] == 1 and not r["traceback"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
