"""The command line.

    python -m parallel devices
    python -m parallel compare [--strategies a,b,...] [run options]   every strategy vs `single`
    python -m parallel run STRATEGY [run options]                      one strategy, no baseline
    python -m parallel bench cpu-vs-gpu | streams | memory             GPU basics (parallel/basics/)
    python -m parallel sweep --lr a,b --batch-size ... --num-workers ... --device cpu,cuda   a grid of runs
    python -m parallel preflight                                       every path for two steps: one line a check

Exit codes: 0 every strategy ran (and every synchronous one matched `single`); 1 a strategy failed or
mismatched (the table says which and why); 2 bad input (one line on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import signal
import sys
import traceback
from pathlib import Path

from rich.markup import escape

from parallel import envinfo, preflight, report, strategies, sweep
from parallel.basics import cli as basics_cli
from parallel.basics.cli import show_memory
from parallel.cliargs import Parser, add_run_options, add_strategy_options, config_from_args, readable_metavars, refuse
from parallel.compare import run_strategies, select_runs
from parallel.config import ConfigError, RunConfig, nearest_multiple
from parallel.judge import diagnose, mutants
from parallel.loop.checkpoint import atomic_save
from parallel.loop.results import Equivalence, Row, prepare_out, write_results
from parallel.models import usermodel
from parallel.models.usermodel import workload_of
from parallel.plan import cli as plan_cli
from parallel.report import page, scaling
from parallel.style.terminal import make_console
from parallel.worker import leave, run_here
from parallel.world import machine
from parallel.world.dist import Dist, script_devices
from parallel.world.errors import REPORT, CheckFailed, first_line, raised_in

# The commands (this docstring is `--help`'s text); their arguments, and the RunConfig made of them: cliargs.py.


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m parallel", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    sub.add_parser("devices", help="what hardware is here, and what each strategy would use")
    cmp = sub.add_parser("compare", help="every strategy on the same model, data and seed, vs `single`")
    cmp.add_argument("--strategies", default="all", help=f"comma list or all ({', '.join(strategies.NAMES)})")
    cmp.add_argument("--project-params", type=float, default=0.0, help="also project model state per GPU by ZeRO "
                     "stage for a model of this many parameters (e.g. 7e9) at 8..1024 GPUs (0: off)")
    cmp.add_argument("--world-sizes", default="", help="scaling sweep over these device counts, e.g. 1,2,4: "
                                                       "strong and weak scaling, scaling.json and PNG plots")
    cmp.add_argument("--wide", action="store_true", help="every column and every note (default: 100 columns; "
                                                        "the rest is in OUT/details.txt and report.html)")
    add_run_options(cmp)
    add_strategy_options(cmp, strategies.all_strategies(), sweep=True)
    run = sub.add_parser("run", help="one strategy through the harness, without the baseline")
    run.add_argument("strategy", help=", ".join(strategies.NAMES))
    run.add_argument("--wide", action="store_true", help="every column and every note")
    rep = sub.add_parser("report", help="a finished run's report again, from OUT/results.json (and report.html)")
    rep.add_argument("out", metavar="OUT", help="the results folder of a compare or run")
    rep.add_argument("--wide", action="store_true", help="every column and every note")
    rep.add_argument("--screenshot", action="store_true", help="also OUT/report.png, report.html as headless "
                                                               "Chromium draws it (apt-get install chromium)")
    add_run_options(run)
    add_strategy_options(run, strategies.all_strategies(), sweep=True)

    basics_cli.add_parser(sub)

    sweep.add_parser(sub)
    preflight.add_parser(sub)
    mutants.add_parser(sub)
    diagnose.add_parser(sub)
    plan_cli.add_parser(sub)
    return readable_metavars(p)


def cmd_compare(args, names: list[str], baseline: bool) -> int:
    config = config_from_args(args)
    params = getattr(args, "project_params", 0)
    if not (math.isfinite(params) and params >= 0):
        raise ConfigError(f"--project-params must be a parameter count (0: off), got {params:g}")
    if getattr(args, "world_sizes", ""):
        return cmd_scaling(config, names, args.world_sizes)
    chosen, skipped = select_runs(config, names, baseline)  # every check before the first file is written
    if config.memory_snapshot and config.memory_snapshot not in {s.name for s, _, _ in chosen}:
        raise ConfigError(f"--memory-snapshot {config.memory_snapshot}: not a strategy this run trains "
                          f"({', '.join(dict.fromkeys(s.name for s, _, _ in chosen))})")
    prepare_out(Path(config.out))
    console = make_console(getattr(args, "wide", False))
    if found := usermodel.describe(workload_of(config)):  # what the harness found in the user's model
        console.print(found, highlight=False, markup=False)
    if config.why:  # the workload the CLI chose, and why (GPUs and none named)
        console.print(config.why, style="dim", highlight=False, markup=False)
    env = machine.environment(config.spec)
    if why := env.get("gpus_unusable"):  # `auto` fell back to the CPU although GPUs are here: say so first
        console.print(f"GPUs not used: {why}", style="yellow", highlight=False, markup=False)
    save = lambda rows: write_results(Path(config.out), dataclasses.asdict(config), env, rows, skipped)  # noqa: E731
    _stop_like_ctrl_c()
    try:
        rows = run_strategies(config, chosen, baseline=baseline, on_row=save)
    except KeyboardInterrupt:  # the running child's process group is killed on the way out (launch.run_child)
        console.print(f"[bold red]interrupted[/]: finished rows are in {escape(config.out)}/results.json")
        return 130

    return report.write(config, rows, console, chosen=chosen, skipped=skipped, env=env, cost=True,
                        project_params=params, wide=getattr(args, "wide", False))


def cmd_scaling(config: RunConfig, names: list[str], sizes_text: str) -> int:
    """compare --world-sizes: one comparison per (strong|weak, device count), then the sweep's table and plots."""
    try:
        sizes = sorted({int(x) for x in sizes_text.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--world-sizes {sizes_text!r}: expected device counts like 1,2,4") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError(f"--world-sizes {sizes_text!r}: device counts must be 1 or more")
    runs = []
    for mode, n, cfg in scaling.points(config, sizes):  # every point checked before the first one runs
        runs.append((mode, n, cfg, *select_runs(cfg, names, baseline=True, strict=False)))
    prepare_out(Path(config.out))
    console = make_console()
    _stop_like_ctrl_c()
    results, done = [], {}  # done: a point's config (its folder aside) -> its rows
    try:
        for mode, n, cfg, chosen, skipped in runs:
            console.print(f"{mode} scaling: {cfg.devices}, global batch {cfg.batch_size}", style="bold", markup=False)
            for name, why in skipped.items():
                console.print(f"  {name} skipped here: {why}", style="dim", highlight=False, markup=False)
            prepare_out(Path(cfg.out))
            env = machine.environment(cfg.spec)
            save = lambda rows, cfg=cfg, env=env: write_results(Path(cfg.out), dataclasses.asdict(cfg), env, rows)  # noqa: E731
            same = dataclasses.replace(cfg, out="").to_json()  # strong and weak on one device are one run
            if same in done:
                console.print("  the same runs as an earlier point: its rows, not measured again", style="dim")
                save(done[same])
            else:
                done[same] = run_strategies(cfg, chosen, baseline=True, on_row=save)
            results.append((mode, n, [Row.from_dict(dataclasses.asdict(r)) for r in done[same]]))  # its own flags
    except KeyboardInterrupt:
        console.print(f"[bold red]interrupted[/]: finished comparisons are in {escape(config.out)}/scaling/")
        return 130
    return scaling.report(config, results, console)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_like_ctrl_c() -> None:
    """SIGTERM (a scheduler, `kill`) and SIGINT stop the run like Ctrl-C: rows kept, children ended. SIGINT
    is set too because a process started with it ignored (`nohup`, `cmd &` in a script, a test runner's
    worker) inherits that, and Python then never raises KeyboardInterrupt: seen as a run that went on."""
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def compare_defaults() -> RunConfig:
    """The config `compare` builds when given no arguments (its own parser and config_from_args: the
    workload, `--devices auto`, the batch rounded to the devices), for `devices` to plan with."""
    return config_from_args(build_parser().parse_args(["compare"]), default_out=False)


def cmd_devices() -> int:
    console = make_console()  # the block to paste into an issue, the hardware, what `compare` runs (#29)
    envinfo.show(console, compare_defaults(), gpus=machine.cuda_info())  # GPUs read once (may start a child)
    show_memory(console)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "devices":
            return cmd_devices()
        if args.command == "bench":
            _stop_like_ctrl_c()
            return basics_cli.main(args, make_console())  # a stop: one line, below
        if args.command == "sweep":
            _stop_like_ctrl_c()
            return sweep.main(args, make_console())
        if args.command == "mutants":
            return mutants.main(args, make_console())
        if args.command == "diagnose":
            return diagnose.main(args, make_console())
        if args.command == "report":
            return page.render(Path(args.out), make_console(args.wide), wide=args.wide, png=args.screenshot)
        if args.command == "preflight":
            _stop_like_ctrl_c()
            return preflight.main(args, make_console())
        if args.command == "plan":
            return plan_cli.main(args, make_console())
        if args.command == "compare":
            return cmd_compare(args, strategies.parse_list(args.strategies), baseline=True)
        return cmd_compare(args, [strategies.get(args.strategy).name], baseline=False)
    except CheckFailed as e:  # the user's model fails where the baseline needs it: nothing can be compared
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - nothing above caught it: whose is it?
        return unexpected(e, getattr(args, "model", ""))
    except KeyboardInterrupt:  # stopped outside the parts that keep their work (after compare's rows: they are
        print("interrupted", file=sys.stderr)  # saved as each ends): one line, no traceback (seen on an H100)
        return 130


def unexpected(error: Exception, model: str) -> int:
    """An exception no check caught. Raised in the user's code (their model's classes, factory or data code,
    errors.raised_in): one line naming their file and line, exit 1 (PARALLEL_TRACEBACK=1: all of it). Raised
    in ours: an internal error, never put on --model: the traceback, a line that says so and where to
    report it, exit 3."""
    if where := raised_in(error, usermodel.their_files()):
        if os.environ.get("PARALLEL_TRACEBACK"):
            traceback.print_exception(error)
        whose = f"--model {model}: your code" if model else "your code"
        print(f"error: {whose} raised {first_line(error)} at {where}", file=sys.stderr)
        return 1
    traceback.print_exception(error)
    print(f"internal error: {first_line(error)}: {REPORT}", file=sys.stderr)
    return 3


def script_main(name: str, argv: list[str] | None = None) -> int:
    """`scripts/<name>.py`: one strategy in this process (or in each torchrun worker), no harness."""
    strategy = strategies.get(name)
    p = Parser(prog=f"scripts/{name}.py", description=strategy.module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_options(p)
    add_strategy_options(p, [strategy], sweep=False)
    args = readable_metavars(p).parse_args(argv)
    try:
        args.devices = script_devices(args.devices, strategy.launch)
        config = config_from_args(args, default_out=False)
        dist = Dist.from_env(config.spec)
        if strategy.launch == "torchrun":  # the world is torchrun's (several nodes included), not the device list
            batch = nearest_multiple(config.batch_size, dist.world_size) if config.batch_auto else config.batch_size
            config = dataclasses.replace(config, world_size=dist.world_size, batch_size=batch)
        config = strategy.adapted(config)
        if config.out and dist.is_main:
            prepare_out(Path(config.out))
        result = run_here(strategy, config, dist)
    except ConfigError as e:
        return refuse(f"error: {e}")
    code = 0 if result is None else _report_script(name, config, *result)  # rank 0 reports
    if dist.launched:  # a torchrun worker: no interpreter teardown, which can abort it (worker.leave)
        leave(code)
    return code


def _report_script(name: str, config: RunConfig, row: Row, state: dict) -> int:
    row.equivalence = Equivalence("unchecked", reason="run alone; `python -m parallel compare` checks it")
    if config.out:  # the trained parameters, for torch.load(..., weights_only=True)
        atomic_save(Path(config.out) / f"{name}_final.pt", state)
    return report.write(config, [row], make_console())
