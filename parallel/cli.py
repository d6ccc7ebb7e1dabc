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
import contextlib
import dataclasses
import difflib
import math
import os
import re
import signal
import sys
import time
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from parallel import envinfo, machine, preflight, profiling, strategies, sweep, usermodel
from parallel.basics import cli as basics_cli
from parallel.basics.cli import show_memory
from parallel.checkpoint import atomic_save
from parallel.config import ConfigError, RunConfig, nearest_multiple
from parallel.devicespec import parse_devices
from parallel.dist import Dist, script_devices
from parallel.harness import costmodel, memcheck, mutants, pictures, report, scaling
from parallel.harness.report import make_console
from parallel.harness.runner import BASELINE, plan, run_strategies
from parallel.plan import cli as plan_cli
from parallel.plan import models as plan_models
from parallel.results import Equivalence, Row, atomic_write, prepare_out, write_results
from parallel.transformer import SHAPE
from parallel.usermodel import workload_of
from parallel.worker import leave, run_here


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, not a usage dump (once, under torchrun: refuse)
        commands = self._commands()
        if commands and message.startswith("the following arguments are required") and \
                (commands.metavar or commands.dest) in message:  # `python -m parallel`, `... bench`: what to type
            raise SystemExit(refuse(self.command_list(commands)))
        if commands and (m := re.search(r"invalid choice: '([^']*)'", message)) and \
                (close := difflib.get_close_matches(m[1], list(commands.choices), n=1)):
            message = message.replace(m[0], f"{m[0]} (did you mean {close[0]!r}?)", 1)
        raise SystemExit(refuse(f"{self.prog}: error: {message}"))

    def parse_args(self, args=None, namespace=None):
        """As argparse's, but an unknown option is refused naming the closest known one of its command."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            chosen = self._chosen(parsed)
            known = [s for a in chosen._actions for s in a.option_strings if s.startswith("--")]
            flags = [x.partition("=")[0] for x in extras if x.startswith("-")] or extras[:1]
            said = []
            for flag in flags:
                close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("-") else []
                said.append(flag + (f" (did you mean {close[0]}?)" if close else ""))
            chosen.error(f"unrecognized argument{'s' * (len(said) > 1)} {', '.join(said)}")
        return parsed

    def _commands(self) -> argparse._SubParsersAction | None:
        return next((a for a in self._actions if isinstance(a, argparse._SubParsersAction)), None)

    def _chosen(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The (sub)parser of the command that `parsed` chose: `bench memory`'s own, for instance."""
        parser = self
        while (commands := parser._commands()) and getattr(parsed, commands.dest, None) in commands.choices:
            parser = commands.choices[getattr(parsed, commands.dest)]
            if not isinstance(parser, _Parser):
                break
        return parser

    def command_list(self, commands: argparse._SubParsersAction) -> str:
        """The usage line and every command with its one-line description (a bare command's answer)."""
        word = commands.metavar or commands.dest.upper()
        names = {a.dest: a.help or "" for a in commands._choices_actions}
        width = max(map(len, names))
        return "\n".join([f"usage: {self.prog} {word} ...", "", f"{word.lower()}s:",
                          *(f"  {name:<{width}}  {about}" for name, about in names.items()), "",
                          f"`{self.prog} {word} --help` lists the options of one."])


def refuse(line: str, env=None) -> int:
    """Bad input: `line` on stderr, once, and exit code 2. Under torchrun every rank meets the same mistake:
    rank 0 alone prints it, and every rank writes it to its torchrun error file (TORCHELASTIC_ERROR_FILE,
    the JSON that @record would fill with a Python call stack), so that torchrun's failure summary shows
    the reason ("traceback : error: global batch ...") instead of "To enable traceback see ..."."""
    env = os.environ if env is None else env
    if env.get("RANK", "0") == "0":
        print(line, file=sys.stderr)
    if path := env.get("TORCHELASTIC_ERROR_FILE"):
        import json

        with contextlib.suppress(OSError):  # the summary then says less; the line above still said it
            Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {
                "timestamp": str(int(time.time()))}}}))
        if env.get("RANK", "0") != "0":  # torchrun stops every rank once one has exited: leave rank 0 a
            time.sleep(1.0)  # second to print (seen: rank 2 left first, rank 0 was killed before printing)
    return 2


def add_run_options(p: argparse.ArgumentParser) -> None:
    d = RunConfig()
    p.add_argument("--workload", default=None, help="model and data: mlp, cnn, transformer, moe or dcgan "
                                                     f"(default {d.workload}; transformer given its shape below)")
    usermodel.add_arguments(p)
    plan_models.add_shape_arguments(p)
    p.add_argument("--aux-loss", type=float, default=d.aux_loss, help="--workload moe: the routers' load-balancing "
                   "loss at this weight (0: off; only `single` and expert_parallel sum its counts over the batch)")
    p.add_argument("--devices", default=d.devices, help="auto | cpu:N (N virtual devices) | cuda:0,1,...")
    p.add_argument("--world-size", type=int, default=d.world_size, help="devices to use (default: all listed)")
    p.add_argument("--batch-size", type=int, default=None, help=f"GLOBAL batch per step (default {d.batch_size}, "
                   "rounded to the nearest multiple of the devices: 513 on 3)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed optimiser steps ({d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed optimiser steps first ({d.warmup}; 1 for a "
                   "shape given on CPUs: a step of seconds is warm after one)")
    p.add_argument("--lr", type=float, default=d.lr, help=f"SGD learning rate ({d.lr})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of weights and data ({d.seed})")
    p.add_argument("--precision", default=None, help="fp32 (the GPU default's: bf16); bf16: every strategy's "
                                                     "steps (and `single`'s) under torch.autocast(bfloat16); fp64: "
                                                     "everything in float64, where rounding cannot flip a ReLU or a "
                                                     "max-pool (tells a bug from rounding: docs/oracle.md)")
    p.add_argument("--profile", action="store_true", help="write torch.profiler traces to OUT/tb/")
    p.add_argument("--memory-cap", dest="memory_cap_mb", type=float, default=d.memory_cap_mb, metavar="MiB",
                   help="memory a device may hold: a strategy the planner puts over it is left out (named: "
                        "refused); on GPUs the allocator is capped too, so one over it runs out of memory (0: none)")
    p.add_argument("--memory-snapshot", default=d.memory_snapshot, metavar="STRATEGY",
                   help="on GPUs, the allocator's history over that strategy's last warm-up step, to OUT/memory/ "
                        "(open it in pytorch.org/memory_viz; docs/gpus.md)")
    p.add_argument("--repeat", type=int, default=d.repeat, help="rounds of every strategy, interleaved; speedups "
                   "are paired with each round's own `single`: median [min-max] (3: the benchmark mode)")
    p.add_argument("--out", default=d.out, help="results folder (default results/run-<time>)")
    p.add_argument("--timeout", type=float, default=d.timeout, help=f"seconds per strategy ({d.timeout:g})")
    p.add_argument("--pg-timeout", type=float, default=d.pg_timeout,
                   help=f"seconds a collective may wait ({d.pg_timeout:g})")
    p.add_argument("--port", type=int, default=d.port, help="rendezvous port on 127.0.0.1 (0: any free port)")
    p.add_argument("--max-restarts", type=int, default=d.max_restarts, help="torchrun restarts after a failure (0)")
    p.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every,
                   help="save model + optimiser to OUT/checkpoints/<strategy>/ (torch.distributed.checkpoint, "
                        "each rank its part) every K steps and at the end (0: never)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints/<strategy>/ if it exists")
    p.add_argument("--resume-from", default=d.resume_from, help="continue from this checkpoint folder (must exist)")
    p.add_argument("--fail-at-step", type=int, default=d.fail_at_step, help="demo/test: raise at this step (-1: never)")
    p.add_argument("--fail-rank", type=int, default=d.fail_rank, help="demo/test: ... on this rank or worker (0)")
    p.add_argument("--hang-rank", type=int, default=d.hang_rank, help="demo/test: this rank stops responding at step 1")
    p.add_argument("--mutant", default=d.mutant, help="test the oracle: run with this injected bug "
                                                      "(python -m parallel mutants --list)")


# What a person reads after each flag in --help; argparse's own is the dest in capitals (WORLD_SIZE,
# OPTION_BUCKET_MB). Filled in by readable_metavars() wherever a flag did not name its own.
METAVARS = {
    "workload": "NAME", "devices": "SPEC", "world_size": "N", "batch_size": "N", "steps": "N", "warmup": "N",
    "lr": "RATE", "seed": "N", "precision": "DTYPE", "repeat": "N", "out": "DIR", "timeout": "SECONDS",
    "pg_timeout": "SECONDS", "port": "PORT", "max_restarts": "N", "checkpoint_every": "K", "resume_from": "DIR",
    "fail_at_step": "STEP", "fail_rank": "RANK", "hang_rank": "RANK", "mutant": "NAME", "strategies": "LIST",
    "project_params": "N", "world_sizes": "LIST", "strategy": "STRATEGY",
    "model": "FILE:FACTORY", "input_shape": "SHAPE", "classes": "N", "vocab": "N", "seq_len": "N", "data": "FILE",
    "aux_loss": "WEIGHT",
}


def readable_metavars(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """METAVARS for every argument of `parser` and of its commands that has none of its own."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                readable_metavars(sub)
        elif action.metavar is None and action.nargs != 0 and action.dest in METAVARS:
            action.metavar = METAVARS[action.dest]
    return parser


def _option_metavar(f, sweep: bool) -> str:
    """A strategy option's metavar: MB for sizes in MiB, 0|1 for switches, N, X or NAME by type; with `sweep`,
    a comma list of them."""
    kind, about = f.type if isinstance(f.type, str) else f.type.__name__, f.metadata.get("help", "")
    switch = kind == "int" and about.startswith("1:") and "2:" not in about  # "1: on ..." (0: off)
    one = "MB" if f.name.endswith("_mb") else "0|1" if switch else {"int": "N", "float": "X"}.get(kind, "NAME")
    return f"{one}[,{one}...]" if sweep else one


_TYPES = {"int": int, "float": float, "str": str}


def _list_of(kind: type):
    def parse(text: str) -> list:
        return [kind(x) for x in text.split(",") if x.strip()]

    parse.__name__ = f"comma-separated {kind.__name__}"  # argparse names it in its error message
    return parse


def add_strategy_options(p: argparse.ArgumentParser, owners: list, sweep: bool) -> None:
    """A flag for every field of the strategies' own Options; with `sweep`, each takes a comma list."""
    fields: dict[str, tuple] = {}
    for s in owners:
        for f in s.option_fields():
            fields.setdefault(f.name, (f, []))[1].append(s.name)
    if not fields:
        return
    g = p.add_argument_group("strategy options" + (" (a comma list runs one variant per value)" if sweep else ""))
    for name, (f, users) in fields.items():
        kind = _TYPES[f.type if isinstance(f.type, str) else f.type.__name__]
        g.add_argument("--" + name.replace("_", "-"), dest=f"option_{name}", default=None,
                       type=_list_of(kind) if sweep else kind, metavar=_option_metavar(f, sweep),
                       help=f"[{', '.join(users)}] {f.metadata.get('help', '')} (default {f.default})")


SHAPED_BATCH = 8  # sequences a step when a shape is given: a preset's 1K-8K tokens each, where 512 of 32 is the default
SHAPED_WARMUP = 1  # ... and warm-up steps on CPUs: at real sizes a step takes seconds, warm after the first
# `compare` on GPUs with no model named (README, "On GPUs"): GPT-2 small's shape in bf16, 8 sequences of 1,024
# tokens a GPU. The CNN's step on an H100 was 3.1 ms of kernel launches; a plain loop at GPT-2 small's shape
# took 31-33 ms at 1-4 sequences and 59.5 at 16 (2026-11-25), so 8 a GPU keeps each GPU's share compute-bound.
GPU_DEFAULT = {"preset": "gpt2-small", "precision": "bf16", "why": "GPUs and no --workload: GPT-2 small's shape "
               "in bf16, 8 sequences a GPU, so that a step is arithmetic, not kernel launches (the CNN's 3 ms on an "
               "H100); --workload cnn for the small one"}


def config_from_args(args: argparse.Namespace, default_out: bool = True) -> RunConfig:
    """The validated RunConfig; the results folder is named but not created (see prepare_out)."""
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    options = {k.removeprefix("option_"): v for k, v in vars(args).items() if k.startswith("option_") and v is not None}
    given = {k: v for k, v in vars(args).items() if k in fields and v is not None}
    spec = parse_devices(given.get("devices", RunConfig.devices))
    shaped = any(given.get(k) for k in ("preset", *SHAPE))
    gpu_default = spec.real and "workload" not in given and not given.get("model") and not shaped
    if gpu_default:  # GPUs and no model named: one whose step is compute, not kernel launches
        given |= {k: v for k, v in GPU_DEFAULT.items() if not given.get(k)}
    given = plan_models.with_preset(given)
    shaped = shaped or gpu_default
    given.setdefault("workload", "transformer" if shaped else RunConfig.workload)
    given.setdefault("warmup", SHAPED_WARMUP if shaped and not spec.real else RunConfig.warmup)
    if given.get("batch_size") is None:  # not given: the default, rounded to the world by validate
        per_gpu = (given.get("world_size") or spec.count) if gpu_default else 1  # the GPU default: 8 a GPU
        given.update(batch_size=SHAPED_BATCH * per_gpu if shaped else RunConfig.batch_size, batch_auto=True)
    config = RunConfig(**given, options=options).validate()
    if not config.out and default_out:
        config.out = str(Path("results") / time.strftime("run-%Y%m%d-%H%M%S"))
    return config


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m parallel", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
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
    plan_cli.add_parser(sub)
    return readable_metavars(p)


def _finish(config: RunConfig, rows: list[Row], console, skipped: dict | None = None, env: dict | None = None,
            cost_model: dict | None = None, wide: bool = False) -> int:
    env = env or machine.environment(config.spec)
    env.setdefault("run", report.run_facts(config))
    if config.out:
        out = Path(config.out)
        write_results(out, dataclasses.asdict(config), env, rows, skipped, cost_model)
        atomic_write(out / "details.txt", report.details_text(rows, env, skipped, cost_model))
        pictures.write(out / "report.html", rows, env, skipped)
    report.show(rows, env, console, skipped, cost_model, wide=wide)
    if config.out:
        logs = ", logs/ (a line a step)" if (Path(config.out) / "logs").is_dir() else ""
        console.print(f"files in {config.out}/:\n  report.html (pictures), details.txt (every row), results.json/.csv"
                      f"{logs}", highlight=False, markup=False)
    return 0 if rows and all(r.ok for r in rows) else 1


def cmd_compare(args, names: list[str], baseline: bool) -> int:
    config = config_from_args(args)
    params = getattr(args, "project_params", 0)
    if not (math.isfinite(params) and params >= 0):
        raise ConfigError(f"--project-params must be a parameter count (0: off), got {params:g}")
    if getattr(args, "world_sizes", ""):
        return cmd_scaling(config, names, args.world_sizes)
    chosen, skipped = plan(config, names, baseline)  # every check before the first file is written
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

    memcheck.attach(rows, chosen, config)  # the planner's memory for each row's layout (counted, not run)
    # The cost model times `single` on the whole model: not where it does not fit (the shallow twin's runs)
    model = {} if BASELINE in skipped else costmodel.apply(rows, chosen, config, env)
    if getattr(args, "project_params", 0):
        model["memory_projection"] = costmodel.memory_projection(args.project_params)
    tracks = config.profile and profiling.merge(Path(config.out) / "tb", Path(config.out) / "timeline.json")
    code = _finish(config, rows, console, skipped, env, model, wide=getattr(args, "wide", False))
    if tracks:
        console.print(f"timeline: {config.out}/timeline.json, {tracks} tracks (every rank of every strategy, each "
                      "strategy from t = 0): open it in https://ui.perfetto.dev or chrome://tracing", highlight=False)
    return code


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
        runs.append((mode, n, cfg, *plan(cfg, names, baseline=True, strict=False)))
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
    scaling.flag_baselines(results)
    every = [dataclasses.replace(r, variant=f"{r.variant} {mode} {n}".strip())
             for mode, n, rows in results for r in rows]
    for line in report.flag_lines(every):  # folded: one line for every row measured under load
        console.print(f"- {line}", style="yellow", highlight=False, markup=False)
    table = scaling.summarize(results)
    files = scaling.write(Path(config.out), table, results, virtual=not config.spec.real)
    t = Table(title="samples/s (efficiency) against devices", title_justify="left")
    t.add_column("strategy")
    for mode, n, _ in results:
        t.add_column(f"{mode} {n}", justify="right")
    for name in dict.fromkeys(r["strategy"] for r in table):
        cells = {(r["mode"], r["devices"]): r for r in table if r["strategy"] == name}
        t.add_row(escape(name), *[f"{c['samples_per_s']:,.0f} ({c['efficiency']:.0%})" if (c := cells.get((m, n))) and
                          c["samples_per_s"] and c["efficiency"] is not None else "-" for m, n, _ in results])
    console.print(t)
    console.print(f"scaling: {config.out}/scaling.json, scaling.csv; plots: " + ", ".join(f.name for f in files),
                  markup=False)
    return 0 if all(r.ok for _, _, rows in results for r in rows) else 1


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
        if args.command == "report":
            return pictures.render(Path(args.out), make_console(args.wide), wide=args.wide, png=args.screenshot)
        if args.command == "preflight":
            _stop_like_ctrl_c()
            return preflight.main(args, make_console())
        if args.command == "plan":
            return plan_cli.main(args, make_console())
        if args.command == "compare":
            return cmd_compare(args, strategies.parse_list(args.strategies), baseline=True)
        return cmd_compare(args, [strategies.get(args.strategy).name], baseline=False)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # stopped outside the parts that keep their work (after compare's rows: they are
        print("interrupted", file=sys.stderr)  # saved as each ends): one line, no traceback (seen on an H100)
        return 130


def script_main(name: str, argv: list[str] | None = None) -> int:
    """`scripts/<name>.py`: one strategy in this process (or in each torchrun worker), no harness."""
    strategy = strategies.get(name)
    p = _Parser(prog=f"scripts/{name}.py", description=strategy.module.__doc__,
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
    return _finish(config, [row], make_console())
