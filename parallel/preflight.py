"""`python -m parallel preflight`: does every path work on the devices here? The first command to run on
a new machine, and the table to paste into an issue.

    python -m parallel preflight [--devices auto] [--strategies all] [--workload cnn] [--out DIR]

Each check runs the real thing for a couple of steps, in a child process (so a crash, a hang or a CUDA
context stays there), and prints one line: passed, failed (the error in one line and its log), or not
run (why: no GPU, for instance). The checks:

    every strategy       two steps through the harness, checked against `single` like any comparison
                         (on GPUs, those that split the sequence also on the transformer, T = 256,
                         where the workload has no attention: context_parallel, fsdp_cp, torch_cp)
    torchrun restart     a rank fails, torchrun restarts the group, it meets again and finishes
    GPU basics           bench cpu-vs-gpu, streams and memory, small sizes; devices' memory figures

Exit code: 0 when no check failed (checks not run do not fail it), 1 otherwise, 2 for bad input.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from parallel import strategies
from parallel.compare import run_strategies, select_runs
from parallel.config import RunConfig, nearest_multiple
from parallel.launch import child as launch
from parallel.loop.results import atomic_write, prepare_out
from parallel.models import usermodel
from parallel.style.terminal import make_progress
from parallel.world.devices import gpu_count
from parallel.world.machine import unusable_gpus


@dataclass
class Check:
    name: str
    proves: str  # what passing it shows
    status: str = "not run"  # "passed" | "failed" | "not run"
    detail: str = ""  # the error in one line (with its log), or why it did not run


def add_parser(sub) -> None:
    p = sub.add_parser("preflight", help="every strategy and the GPU basics for two steps: one line per check")
    p.add_argument("--devices", default="auto", metavar="SPEC",
                   help="auto | cpu:N | cuda:0,1,... (auto: every GPU, else cpu:2)")
    p.add_argument("--strategies", default="all", metavar="LIST",
                   help=f"comma list or all ({', '.join(strategies.NAMES)})")
    p.add_argument("--workload", default="cnn", metavar="NAME", help="the model the strategies train (cnn)")
    usermodel.add_arguments(p)
    p.add_argument("--out", default="", metavar="DIR", help="results folder (default results/preflight-<time>)")
    p.add_argument("--timeout", type=float, default=180.0, metavar="SECONDS", help="seconds per check (180)")


def _config(args) -> RunConfig:
    import time

    out = args.out or str(Path("results") / time.strftime("preflight-%Y%m%d-%H%M%S"))
    model = {k: getattr(args, k) for k in ("model", "input_shape", "classes", "vocab", "seq_len", "data")}
    return RunConfig(workload=args.workload, **model, devices=args.devices, batch_size=64, batch_auto=True,
                     steps=2, warmup=1, timeout=args.timeout, pg_timeout=min(60.0, args.timeout), out=out,
                     extras=False).validate()  # a path proven, not measured: no strategy's own measurements


def strategy_checks(config: RunConfig, chosen: list[tuple], skipped: dict[str, str], done: list[Check]) -> None:
    """The strategies that can run here, two steps through the harness with `single` as the baseline;
    each finished one is in `done` at once (kept when the run is stopped)."""
    start = len(done)

    def keep(rows):  # the rows so far replace this call's checks so far
        done[start:] = _rows_checked(config, rows)

    run_strategies(config, chosen, on_row=keep)
    done += [Check(f"{n} on {config.devices}", "its launch on these devices", "not run", why)
             for n, why in skipped.items()]


def _rows_checked(config: RunConfig, rows: list) -> list[Check]:
    checks = []
    for r in rows:
        c = Check(f"{r.label} on {config.devices}", f"{r.launcher} launch, {r.world_size} device(s), 2 steps, "
                                                    "checked against single")
        log = Path(config.out) / "logs" / f"{r.label.replace(' ', '-')}.log"
        if r.ok:
            c.status, c.detail = "passed", f"equivalence {r.equivalence.verdict}"
        else:
            why = r.error or f"{r.equivalence.verdict}: {r.equivalence.reason}"
            c.status, c.detail = "failed", f"{why} (log: {log})"
        checks.append(c)
    return checks


SEQUENCE_RUN = {"workload": "transformer", "seq_len": 256, "batch_size": 8}
EXPERTS_RUN = {"workload": "moe", "batch_size": 8}
# Strategies that need what the preflight's workload may not have, checked on GPUs on a workload that has it:
# (the strategy's constant, the workload's property, the run, its folder under OUT)
ELSEWHERE = (("SEQUENCE", "splits_sequence", SEQUENCE_RUN, "sequence"), ("EXPERTS", "experts", EXPERTS_RUN, "experts"))


def elsewhere_names(config: RunConfig, names: list[str]) -> dict[str, list[str]]:
    """On GPUs, {folder: strategies} that the preflight's workload cannot feed (no attention to split by the
    sequence, no experts), to check on the transformer at T = 256 or the MoE instead (torch's
    context_parallel() and every nccl path run only on GPUs; the suite covers the CPU)."""
    if not config.spec.real:
        return {}
    workload, wanted = usermodel.workload_of(config), strategies.NAMES if "all" in names else names
    out = {}
    for constant, offers, _, folder in ELSEWHERE:
        if not getattr(workload, offers) and (found := [n for n in wanted if getattr(strategies.get(n), constant)]):
            out[folder] = found
    return out


def elsewhere_checks(config: RunConfig, found: dict[str, list[str]], checks: list[Check]) -> None:
    for _, _, run, folder in ELSEWHERE:
        if folder not in found:
            continue
        fields = {"model": "", "input_shape": "", "classes": 0, "vocab": 0, "data": "", "seq_len": 0, "aux_loss": 0.0}
        other = dataclasses.replace(config, **{**fields, **run}, out=str(Path(config.out) / folder)).validate()
        chosen, skipped = select_runs(other, found[folder], strict=False)
        prepare_out(Path(other.out))
        strategy_checks(other, chosen, skipped, checks)


def _child(name: str, proves: str, argv: list[str], config: RunConfig, env: dict | None = None) -> Check:
    log = Path(config.out) / "logs" / f"preflight-{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.log"
    # forked from the zygote (launch/zygote.py; launch.may_fork); torchrun's workers here are scripts
    outcome = launch.run_child([sys.executable, *argv], config.timeout, log, env=env,
                               fork=launch.may_fork(gpu_count() > 0))
    if outcome.returncode == 0 and not outcome.timed_out:
        return Check(name, proves, "passed", f"{outcome.wall_s:.0f} s")
    return Check(name, proves, "failed", f"{outcome.error} (log: {log})")


def restart_check(config: RunConfig) -> Check:
    """torchrun as a user types it, launched the harness's way (a rendezvous store on 127.0.0.1 that this
    process hosts, every socket on loopback: launch.py): rank 1 fails at step 2, torchrun restarts the
    group once, and the group must meet again (in a fresh store: see Dist._store) and finish."""
    n = min(2, config.spec.count)
    devices = str(config.spec.first(n))
    out = Path(config.out) / "restart"
    store = launch.LoopbackStore(0, config.timeout)
    # Each worker is forked from the zygote through a stand-in (launch/forked.py), as the harness's own
    # launches are (launch.may_fork): torchrun, its rendezvous and its restart are the same
    # `python -m parallel.script ddp`: what scripts/ddp.py runs, from the package (installed or not)
    module = ["-m", "parallel.launch.forked", "parallel.script"] if launch.may_fork(gpu_count() > 0) else \
        ["-m", "parallel.script"]
    argv = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={n}", "--max-restarts=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{store.port}", "--rdzv-conf=is_host=false",
            "--local-addr=127.0.0.1", *module, "ddp", *usermodel.argv(config),
            "--devices", devices, "--steps", "4", "--warmup", "0", "--batch-size", str(nearest_multiple(64, n)),
            "--fail-at-step", "2", "--fail-rank", str(n - 1), "--out", str(out)]
    try:
        return _child("torchrun restart after a failed rank", f"torchrun --max-restarts=1 re-forms a group of {n} "
                      f"({config.spec.backend}, on 127.0.0.1) and finishes", argv, config, env=launch.torchrun_env())
    finally:
        store.close()


def basics_checks(config: RunConfig, checks: list[Check]) -> None:
    """The GPU basics at their smallest sizes and fewest trials, each appended to `checks` as it ends."""
    gpu = gpu_count() > 0
    out = str(Path(config.out) / "basics")
    for name, proves, argv in [
        ("bench cpu-vs-gpu", "each case timed synchronized and naively" + ("" if gpu else "; CPU side only"),
         ["bench", "cpu-vs-gpu", "--scale", "0.01", "--repeats", "3", "--out", out]),
        ("bench memory", "fp32, autocast (fp16 + GradScaler on CUDA, bf16 on CPU), checkpointing",
         ["bench", "memory", "--workload", "cnn", "--batch-size", "32", "--budget-mb", "0", "--out", out]),
        ("devices", "memory per device, read without a CUDA context; allocate, free, empty_cache", ["devices"]),
        ("bench streams", "a side-stream race and its two fixes", ["bench", "streams", "--trials", "3", "--out", out]),
    ]:
        if name == "bench streams" and not gpu:
            checks.append(Check(name, proves, "not run", "needs CUDA"))
        else:
            checks.append(_child(name, proves, ["-m", "parallel", *argv], config))


def cuda_only(config: RunConfig) -> list[Check]:
    """What only GPUs can show, listed as not run where there are none; on one shared GPU, what needs two
    or more GPUs of their own."""
    if config.spec.shared:
        why = f"needs 2+ GPUs of their own; {config.devices} is one GPU shared by {config.spec.count} ranks"
        return [Check(name, proves, "not run", why) for name, proves in [
            ("strategies over nccl", "nccl's collectives between GPUs (ranks sharing a GPU talk over gloo), their "
                                     "real speed, and overlap of communication with compute"),
            ("pipeline_dist, fsdp_pp", "torch's pipelining sending activations GPU to GPU (gloo cannot send CUDA "
                                       "tensors point to point)"),
            ("tensor_parallel, fsdp_tp", "DTensor's collectives on GPUs (they crash on gloo with CUDA tensors)"),
            ("speedup on GPUs", "what splitting the work gains: ranks sharing one GPU take turns on it"),
        ]]
    if config.spec.real:
        return []
    why = (unusable_gpus() or "no CUDA device here") if not gpu_count() else \
        f"--devices {config.devices} is not a GPU list"
    return [Check(name, proves, "not run", why) for name, proves in [
        ("strategies on GPUs (nccl)", "every strategy on cuda:0..N-1, peak memory of every device, CUDA events "
                                      "inside the step"),
        ("bench cpu-vs-gpu, GPU rows", "synchronized vs naive on a GPU, CuPy"),
        ("bench memory, fp16 + GradScaler", "CUDA autocast and loss scaling, max_memory_allocated"),
        ("devices, CUDA memory", "NVML figures without a context, empty_cache on the caching allocator"),
    ]]


def table(checks: list[Check]) -> Table:
    style = {"passed": "green", "failed": "bold red", "not run": "yellow"}
    t = Table(title="preflight", title_justify="left")
    for col in ("check", "result", "detail", "what it proves"):  # a check's name and result stay whole
        t.add_column(col, overflow="fold", no_wrap=col in ("check", "result"))
    for c in checks:
        t.add_row(escape(c.name), f"[{style[c.status]}]{c.status}[/]", escape(c.detail), escape(c.proves))
    return t


def main(args, console) -> int:
    config = _config(args)
    chosen, skipped = select_runs(config, strategies.parse_list(args.strategies))  # bad input refused before any write
    prepare_out(Path(config.out))
    other = elsewhere_names(config, strategies.parse_list(args.strategies))  # on GPUs: their own workloads, below
    moved = {n for names in other.values() for n in names}
    checks: list[Check] = []  # every finished check, as it finishes: a stop keeps them
    try:
        strategy_checks(config, chosen, {n: why for n, why in skipped.items() if n not in moved}, checks)
        elsewhere_checks(config, other, checks)  # each makes its OUT/logs/, with its own progress bar
        with make_progress(console) as progress:
            task = progress.add_task("GPU basics, torchrun restart", total=2)
            basics_checks(config, checks)
            progress.advance(task)
            checks.append(restart_check(config))
            progress.advance(task)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM (cli._stop_like_ctrl_c): run_child ended the running check
        _write(config, checks, stopped=True)
        console.print(f"interrupted: {len(checks)} finished checks are in {config.out}/preflight.json",
                      markup=False, style="bold red", soft_wrap=True)  # one line: a path is not folded
        return 130
    checks += cuda_only(config)
    _write(config, checks)
    console.print(table(checks))
    failed = [c for c in checks if c.status == "failed"]
    console.print(f"{sum(c.status == 'passed' for c in checks)} passed, {len(failed)} failed, "
                  f"{sum(c.status == 'not run' for c in checks)} not run; {config.out}/preflight.json", markup=False)
    return 1 if failed else 0


def _write(config: RunConfig, checks: list[Check], stopped: bool = False) -> None:
    atomic_write(Path(config.out) / "preflight.json", json.dumps(
        {"devices": config.devices, "workload": config.workload, "stopped": stopped,
         "checks": [dataclasses.asdict(c) for c in checks]}, indent=2))
