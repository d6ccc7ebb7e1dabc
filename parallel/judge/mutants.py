"""The oracle's evidence: every strategy's injected bugs run against `single` and judged, and false alarms counted.

    python -m parallel mutants [--list] [--honest SEEDS [--devices cpu:2,cpu:4] [--size tests]] [--out DIR]

Every bug (base.Mutant) is switched on through `--mutant NAME`, the same switch a user can give `run`,
and must come out "mismatch"; the command exits 0 only then. `--honest SEEDS` is the other half: every
synchronous strategy on every workload it trains, for each seed and device count, at the default run's
size or the test suite's (--size tests), none of which may mismatch; it prints, per strategy and workload,
the largest err/tol beside the smallest of that strategy's injected bugs (docs/oracle.md).

The runs share a few spawned processes (launch/ranks.py): one runs `single` and the in-process
strategies, a gloo group per world size the torchrun ones. The strategies' code is the same as under
the harness; a child process and a torchrun start per run would cost about 6 s each (FIELD-NOTES) for
nothing the oracle looks at, and the harness's own path is tested by the comparison's tests.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import tempfile
import time
from collections.abc import Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.markup import escape

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import equivalence, named
from parallel.judge.mutants_view import show_honest, show_mutants
from parallel.judge.named import caught
from parallel.judge.references import References
from parallel.launch.ranks import run_ranks
from parallel.loop.results import Equivalence, atomic_write
from parallel.models.workloads import WORKLOADS
from parallel.worker import execute
from parallel.world.dist import Dist
from parallel.world.errors import ConfigError

# The run every mutant starts from (its Mutant.run overrides it): small, so the whole catalogue is quick,
# with steps enough for a bug that starts at step 1 (a stale replica, detached gradients) to show.
# Under SGD unless the bug says otherwise: most of the catalogue scales a gradient (summed, not averaged), which
# AdamW's normalised update all but ignores (docs/optimizer.md); the step's own bugs name AdamW (base.ADAMW)
MUTANT_RUN = {"devices": "cpu:2", "batch_size": 64, "steps": 4, "warmup": 1, "workload": "mlp", "extras": False,
              "optimizer": "sgd"}


@dataclass(frozen=True)
class Job:
    strategy: str
    config: str  # a validated RunConfig, as JSON (it travels to the spawned ranks)
    label: str  # the mutant's name, or "honest"


@dataclass
class Outcome:
    label: str
    strategy: str
    workload: str
    devices: str
    seed: int
    equivalence: Equivalence
    old_rule_match: bool | None  # what the rule before per-tensor tolerances would have said
    seconds: float
    named: str = ""  # the one line a diagnosis gave (--check-replicas's; a hang's is the verdict's reason)
    checked: int | None = None  # --check-replicas: the steps it compared (None: not asked)


def mutant_config(mutant, precision: str = "fp32") -> RunConfig:
    run = {**MUTANT_RUN, "precision": precision, **mutant.run}
    return RunConfig(**{k: v for k, v in run.items() if k != "options"}, options=run.get("options", {}),
                     mutant=mutant.name).validate()


def mutant_jobs(precision: str = "fp32", refused: dict[str, str] | None = None,
                only: Collection[str] = ()) -> list[Job]:
    """A job per injected bug (of `only`, where given); one whose run this torch refuses (a schedule it cannot
    run over gloo) is left out, its reason put in `refused` (name -> reason) where given."""
    jobs = []
    for name, (strategy, mutant) in strategies.mutants().items():
        if only and name not in only:
            continue
        try:  # a bug on a model the repository's examples hold (and transformers) is refused where they are not
            config = mutant_config(mutant, precision)
            strategy.validate(config)
        except ConfigError as e:
            if refused is None:
                raise
            refused[name] = str(e)
            continue
        jobs.append(Job(strategy.name, config.to_json(), name))
    return jobs


# The size of the test suite's parity runs (tests/test_oracle.py): `--honest N --size tests` measures the
# noise the suite's margins are set from, `--size default` the noise of a default comparison. There the
# token models take a batch of 16 (512 tokens a step; 48 cost 3x the CNN's run).
SIZES, TOKEN_BATCH = {"default": {}, "tests": {"batch_size": 48, "steps": 5, "warmup": 1}}, {"tests": 16}


def sized(size: str, workload: str) -> dict:
    """The RunConfig fields of a run at `size` (SIZES) on `workload`."""
    tokens = size in TOKEN_BATCH and WORKLOADS[workload].data == "tokens"
    return {**SIZES[size], **({"batch_size": TOKEN_BATCH[size]} if tokens else {})}


def honest_jobs(seeds: int, devices: tuple[str, ...] = ("cpu:2",), base: dict | None = None,
                workloads: tuple[str, ...] | None = None, size: str = "default") -> list[Job]:
    """Every synchronous strategy (but the baseline) on every workload it trains, for seeds 0..seeds-1 on
    each of `devices`: workloads fastest, then devices, then seeds; a strategy that refuses a combination
    (tensor parallelism over 3 ranks: 4 heads and 1024 features do not divide) sits that one out. `size`:
    SIZES' name; `base`: RunConfig fields over it; a batch that a device count does not divide is rounded
    down to one it does (512 on cpu:3: 510)."""
    jobs = []
    for seed, device, workload in itertools.product(range(seeds), devices, workloads or tuple(WORKLOADS)):
        fields = {"batch_size": 512, "extras": False, **sized(size, workload), **(base or {})}  # the verdict only
        draft = RunConfig(workload=workload, devices=device, seed=seed, **fields)
        draft.batch_size -= draft.batch_size % draft.spec.count  # the devices parsed once: validate takes them
        config = draft.validate()
        for s in strategies.all_strategies():
            runs_here = not s.unsupported(WORKLOADS[workload]) and not s.available(config.spec)
            if s.synchronous and s.name != "single" and runs_here:
                try:
                    s.validate(config)
                except ConfigError:
                    continue
                jobs.append(Job(s.name, config.to_json(), "honest"))
    return jobs


HANGS_AT_ONCE = 3  # hang bugs run side by side: each set of ranks idles until its short timeout
GROUP_JOBS = 60  # runs per set of ranks: torch's state grew to 5 GB a rank over 400 fp64 runs in one set


def run_jobs(jobs: list[Job], total: float = 900.0, pg_timeout: float = 120.0) -> list[Outcome]:
    """Run and judge every job; outcomes in the jobs' order. First one process runs `single` for every
    distinct run and the in-process strategies; then a group per world size runs the torchrun ones, all
    ranks busy at once (no rank waits in a collective while another trains alone). `total`: seconds a
    group may take in all; `pg_timeout`: seconds one collective may wait."""
    hang = {i for i, j in enumerate(jobs) if named.shows(j.label) == "hang"}  # each on ranks of its own
    torchrun = {i for i, j in enumerate(jobs) if strategies.get(j.strategy).launch == "torchrun"} - hang
    baselines = sorted({_baseline(j).to_json() for i, j in enumerate(jobs) if i not in hang})
    with tempfile.TemporaryDirectory(prefix="references-") as folder:
        outcomes = run_ranks(_in_process, 1, ([(i, j) for i, j in enumerate(jobs) if i not in torchrun | hang],
                                              baselines, folder), timeout=pg_timeout, total=total)[0]
        with ThreadPoolExecutor(HANGS_AT_ONCE) as pool:  # a hang's ranks mostly wait out its --pg-timeout
            ran = pool.map(lambda i: _hung(jobs[i], Path(folder)), sorted(hang))
            outcomes.update(zip(sorted(hang), ran, strict=True))
        for world in sorted({_world(jobs[i]) for i in torchrun}):
            indexed = [(i, jobs[i]) for i in sorted(torchrun) if _world(jobs[i]) == world]
            for at in range(0, len(indexed), GROUP_JOBS):  # fresh ranks every GROUP_JOBS runs
                chunk = indexed[at:at + GROUP_JOBS]
                outcomes.update(run_ranks(_spmd, world, (chunk, folder), timeout=pg_timeout, total=total)[0])
    return [outcomes[i] for i in range(len(jobs))]


def _hung(job: Job, folder: Path) -> Outcome:
    config = RunConfig.from_json(job.config)
    verdict, seconds = named.run_hang(job, folder)
    return Outcome(job.label, job.strategy, config.workload, config.devices, config.seed, verdict, None, seconds,
                   verdict.reason)


def _world(job: Job) -> int:
    return RunConfig.from_json(job.config).world_size


def _baseline(job: Job) -> RunConfig:
    """The `single` run a job is judged against: the same run without the bug and the strategy's options."""
    return dataclasses.replace(RunConfig.from_json(job.config), mutant="", options={})


def _in_process(rank: int, world: int, indexed: list[tuple[int, Job]], baselines: list[str], folder: str):
    """One process: `single` for every baseline (saved to `folder`), then every in-process job, judged."""
    single, refs = strategies.get(strategies.BASELINE), References(folder)
    for key in baselines:
        config = RunConfig.from_json(key)
        refs.put(key, equivalence.reference_of(config, *execute(single, config, Dist())))
    return {i: _run(job, Dist(), refs) for i, job in indexed}


def _spmd(rank: int, world: int, indexed: list[tuple[int, Job]], folder: str) -> dict[int, Outcome] | None:
    """Every rank runs every torchrun job; rank 0 judges."""
    dist, refs = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world), References(folder)
    out = {i: _run(job, dist, refs) for i, job in indexed}
    return out if rank == 0 else None


def _run(job: Job, dist: Dist, refs: References) -> Outcome | None:
    s, config = strategies.get(job.strategy), RunConfig.from_json(job.config)
    start = time.perf_counter()
    try:
        row, state = execute(s, config, dist)
    except Exception as e:
        raise RuntimeError(f"{job.label} run of {job.strategy} failed: {type(e).__name__}: {e}") from e
    if not dist.is_main:
        return None
    ref = refs.get(_baseline(job).to_json())
    return Outcome(job.label, s.name, config.workload, config.devices, config.seed,
                   equivalence.judge(s, config, ref, row, state), equivalence.global_rule(ref, state),
                   time.perf_counter() - start, row.details.get("replicas_diverged", ""),
                   row.details.get("replicas_checked"))


def add_parser(sub) -> None:
    p = sub.add_parser("mutants", help="the oracle's evidence: every injected bug must be caught")
    p.add_argument("--list", action="store_true", help="list the injected bugs and exit")
    p.add_argument("--only", default="", metavar="NAMES",
                   help="run only these injected bugs, comma-separated (default: the whole catalogue)")
    p.add_argument("--honest", type=int, default=0, metavar="SEEDS",
                   help="also honest runs of every synchronous strategy on every workload it trains, seeds "
                        "0..SEEDS-1 on each of --devices: none may mismatch; the largest err/tol per strategy and "
                        "workload is printed beside its smallest injected bug's")
    p.add_argument("--devices", default="cpu:2,cpu:4", metavar="LIST",
                   help="the device counts of the honest runs, comma-separated (default cpu:2,cpu:4: the test suite's)")
    p.add_argument("--workloads", default="", metavar="LIST",
                   help="the honest runs' workloads, comma-separated (default: every built-in one)")
    p.add_argument("--size", default="default", choices=sorted(SIZES),
                   help="the honest runs' size: the default comparison's (batch 512, 20 + 3 steps) or the test "
                        "suite's parity runs' (batch 48, the token models' 16; 5 + 1 steps), whose noise the "
                        "suite's margins come from")
    p.add_argument("--precision", default="fp32", metavar="DTYPE",
                   help="fp32; bf16: every run (and `single`) under bf16 autocast, judged by the bf16 rule, "
                        "which is looser; fp64: every run in float64, judged by the fp64 rule, far sharper")
    p.add_argument("--optimizer", default="", metavar="NAME",
                   help="the honest runs' optimiser: adamw, muon or sgd (default: each workload's own, AdamW where "
                        "a transformer trains); each injected bug keeps its own")
    p.add_argument("--out", default="", metavar="DIR", help="also write mutants.json (and honest.json) to this folder")


def main(args, console) -> int:
    if args.honest < 0:
        raise ConfigError(f"--honest must be 0 or more, got {args.honest}")
    if args.list:
        for name, (_, m) in strategies.mutants().items():
            console.print(f"{escape(name)}: {escape(m.bug)}  [dim]{escape(json.dumps(m.run))}[/]", highlight=False)
        return 0
    only = {n.strip() for n in args.only.split(",") if n.strip()}
    if unknown := sorted(only - strategies.mutants().keys()):
        raise ConfigError(f"--only: no injected bug named {', '.join(unknown)} (`mutants --list` lists them)")
    if args.out:
        from parallel.loop.results import prepare_out

        prepare_out(Path(args.out))
    refused: dict[str, str] = {}
    outcomes = run_jobs(mutant_jobs(args.precision, refused, only))
    show_mutants(outcomes, console)
    for name, why in refused.items():
        console.print(f"not run on torch {torch.__version__}: {name} ({why})", markup=False)
    ok = all(map(caught, outcomes))
    files = {"mutants.json": outcomes}
    if args.honest:
        devices = tuple(d.strip() for d in args.devices.split(",") if d.strip())
        for d in devices:
            RunConfig(devices=d).validate()  # a bad device list is one line, before any run
        workloads = tuple(w.strip() for w in args.workloads.split(",") if w.strip()) or None
        for w in workloads or ():
            RunConfig(workload=w).validate()  # an unknown name is one line, before any run
        base = {"precision": args.precision, "optimizer": args.optimizer}
        RunConfig(**base).validate()  # an unknown optimiser is one line, before any run
        honest = run_jobs(honest_jobs(args.honest, devices, base, workloads, args.size), total=4 * 3600)
        show_honest(honest, outcomes, console)
        ok = ok and all(o.equivalence.verdict == "match" for o in honest)
        files["honest.json"] = honest
    if args.out:
        for name, rows in files.items():
            atomic_write(Path(args.out) / name, json.dumps([dataclasses.asdict(o) for o in rows], indent=2))
    return 0 if ok else 1
