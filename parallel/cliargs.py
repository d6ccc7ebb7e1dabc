"""The command line's arguments: the parser (one line and exit 2 on bad input, the closest known name
suggested), the run options every training command takes, the strategies' own options, readable
metavars, and config_from_args, the validated RunConfig they make. The commands themselves are cli.py's.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import sys
import time
from pathlib import Path

from parallel.config import RunConfig
from parallel.loop.optim import OPTIMIZERS, SCHEDULES
from parallel.models import usermodel
from parallel.models.data import TOKENS
from parallel.models.transformer import SHAPE
from parallel.plan import models as plan_models
from parallel.world.devicespec import parse_devices


class Parser(argparse.ArgumentParser):
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
            if not isinstance(parser, Parser):
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
    p.add_argument("--tokens", default=d.tokens, choices=TOKENS, help="token batches: even (every position a "
                   "target) or padded (documents of drawn lengths, the padding out of the loss: ranks hold "
                   "different numbers of real tokens; docs/loss.md)")
    p.add_argument("--devices", default=d.devices, help="auto | cpu:N (N virtual devices) | cuda:0,1,...")
    p.add_argument("--world-size", type=int, default=d.world_size, help="devices to use (default: all listed)")
    p.add_argument("--batch-size", type=int, default=None, help=f"GLOBAL batch per step (default {d.batch_size}, "
                   "rounded to the nearest multiple of the devices: 513 on 3)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"timed optimiser steps ({d.steps})")
    p.add_argument("--warmup", type=int, default=None, help=f"untimed optimiser steps first ({d.warmup}; 0 for a "
                   "shape given on CPUs whose step is seconds of arithmetic: warm from the first)")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZERS, help="adamw (the default where a "
                   "transformer trains) or sgd (with momentum: the default elsewhere); docs/optimizer.md")
    p.add_argument("--lr", type=float, default=d.lr, help="peak learning rate (AdamW 3e-3, SGD 0.02)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay, help="on matrices only, never norms, "
                   "biases or embeddings (AdamW 0.1, decoupled; SGD 0)")
    p.add_argument("--betas", default=d.betas, help=f"AdamW's B1,B2 ({d.betas})")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, help="clip the whole model's gradient norm to "
                   "this, computed across every rank (AdamW 1.0, SGD 0: off)")
    p.add_argument("--lr-schedule", default=d.lr_schedule, choices=SCHEDULES, help="the learning rate: constant or "
                   "cosine (to a tenth of --lr), after --warmup-steps")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps, help="the learning rate's linear warm-up, "
                   f"in optimiser steps ({d.warmup_steps}; not --warmup, the untimed steps)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of weights and data ({d.seed})")
    p.add_argument("--precision", default=None, help="fp32 (the GPU default's: bf16); bf16: every strategy's "
                                                     "steps (and `single`'s) under torch.autocast(bfloat16); "
                                                     "bf16-master: bf16 weights and gradients, fp32 master weights "
                                                     "and moments (docs/optimizer.md); fp64: "
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
    p.add_argument("--hang-rank", type=int, default=d.hang_rank,
                   help="demo/test: this rank stops at step 1's first gradient collective (docs/debugging.md)")
    p.add_argument("--hang-how", default=d.hang_how, choices=("stop", "kill"),
                   help="demo/test: --hang-rank's rank stops responding there (stop), or is killed by SIGKILL (kill)")
    p.add_argument("--debug-collectives", action="store_true",
                   help="torch checks every collective's op and shapes across the ranks before it runs "
                        "(TORCH_DISTRIBUTED_DEBUG=DETAIL): a mismatch is named at once, at a cost (docs/debugging.md)")
    p.add_argument("--check-replicas", action="store_true", help="after every step, checksum what ranks must hold "
                   "alike (replicas, reduced gradients, the loss) and name the first difference")
    p.add_argument("--mutant", default=d.mutant, help="test the oracle: run with this injected bug "
                                                      "(python -m parallel mutants --list)")


# What a person reads after each flag in --help; argparse's own is the dest in capitals (WORLD_SIZE,
# OPTION_BUCKET_MB). Filled in by readable_metavars() wherever a flag did not name its own.
METAVARS = {
    "workload": "NAME", "devices": "SPEC", "world_size": "N", "batch_size": "N", "steps": "N", "warmup": "N",
    "optimizer": "adamw|muon|sgd", "lr_schedule": "constant|cosine", "lr": "RATE", "weight_decay": "W",
    "betas": "B1,B2", "clip_norm": "NORM", "warmup_steps": "N",
    "seed": "N", "precision": "DTYPE", "repeat": "N", "out": "DIR", "timeout": "SECONDS",
    "pg_timeout": "SECONDS", "port": "PORT", "max_restarts": "N", "checkpoint_every": "K", "resume_from": "DIR",
    "fail_at_step": "STEP", "fail_rank": "RANK", "hang_rank": "RANK", "hang_how": "stop|kill", "mutant": "NAME",
    "strategies": "LIST", "project_params": "N", "world_sizes": "LIST", "strategy": "STRATEGY",
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
WARM_FLOPS = 1e11  # ... and on CPUs a step of more arithmetic (6 x parameters x tokens) than this, about a second
# of one core here, has no warm-up: it is warm from the first (GPT-2 small's shape at 2 blocks, 1.1e12: 9,400 ms,
# then 9,367 and 9,214; 16 rows' first steps 93-118% of their second, median 104%: docs/measurements.md), so a
# warm-up step would only add its seconds. The report says what the first step added (notes.first_steps).
# `compare` on GPUs with no model named (README, "On GPUs"): GPT-2 small's shape in bf16, 8 sequences of 1,024
# tokens a GPU. The CNN's step on an H100 was 3.1 ms of kernel launches; a plain loop at GPT-2 small's shape
# took 31-33 ms at 1-4 sequences and 59.5 at 16 (2026-11-25), so 8 a GPU keeps each GPU's share compute-bound.
GPU_DEFAULT = {"preset": "gpt2-small", "precision": "bf16", "why": "GPUs and no --workload: GPT-2 small's shape "
               "in bf16, 8 sequences a GPU, so that a step is arithmetic, not kernel launches (the CNN's 3 ms on an "
               "H100); --workload cnn for the small one"}


def step_flops(config: RunConfig) -> float:
    """A training step's arithmetic: 6 x parameters x tokens of the global batch (forward 2, backward 4)."""
    params = sum(p.numel() for p in usermodel.shape_model(config).parameters())
    return 6.0 * params * config.batch_size * usermodel.workload_of(config).input_shape[0]


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
    if given.get("batch_size") is None:  # not given: the default, rounded to the world by validate
        per_gpu = (given.get("world_size") or spec.count) if gpu_default else 1  # the GPU default: 8 a GPU
        given.update(batch_size=SHAPED_BATCH * per_gpu if shaped else RunConfig.batch_size, batch_auto=True)
    config = RunConfig(**given, options=options)
    config.spec = spec  # parsed once, above: validate takes this parse
    config = config.validate()
    if "warmup" not in given and shaped and not spec.real and config.hang_rank < 0 and step_flops(config) > WARM_FLOPS:
        config = dataclasses.replace(config, warmup=0).validate()  # (--hang-rank keeps its warm-up: it stops step 1)
    if not config.out and default_out:
        config.out = str(Path("results") / time.strftime("run-%Y%m%d-%H%M%S"))
    return config
