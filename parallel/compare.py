"""Run a list of strategies, each in its own child, and turn their results into report rows.

`single` runs first when a baseline is wanted: its parameters are the reference for equivalence and its
samples/s the denominator of every speedup, measured in the same run. With --repeat K the whole list runs
K times in turn (single, a, b, ..., single, a, b, ...), so that the machine's drift falls on every strategy
alike: each round's speedup is that round's samples/s over that round's `single`, and a row reports the
median of its K paired speedups and their range. Equivalence is judged on the first round only (later
rounds train the same thing again), so the verdict does not depend on K.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import diagnose, equivalence, noise, twin
from parallel.launch import child as launch
from parallel.loop import checkpoint, profiling
from parallel.loop.results import Equivalence, Row, file_stem, tb_run
from parallel.measure import pipelines
from parallel.models.userchecks import cannot_match
from parallel.models.usermodel import checked_env, shape_model, workload_of
from parallel.models.workloads import eval_loss
from parallel.style.terminal import make_progress
from parallel.worker import HANG_DIR
from parallel.world import load
from parallel.world.errors import CheckFailed, ConfigError, from_a_collective

BASELINE = strategies.BASELINE


def _failed_row(strategy, variant: str, config: RunConfig, outcome: launch.Outcome) -> Row:
    return Row(strategy.name, variant, strategy.launch, config.devices, strategy.kind(config),
               strategy.world_size(config), config.batch_size,
               status="timed-out" if outcome.timed_out else "failed", error=outcome.error)


def run_one(strategy, variant: str, config: RunConfig, work: Path, logs: Path) -> tuple[Row, dict | None]:
    stem = file_stem(strategy.name, variant)
    paths = {"config": work / f"{stem}.config.json", "result": work / f"{stem}.json", "state": work / f"{stem}.pt"}
    paths["config"].write_text(config.to_json())
    store = launch.LoopbackStore(config.port, config.timeout) if strategy.launch == "torchrun" else None
    gpus = [d.index for d in map(config.spec.device, range(strategy.world_size(config))) if d.type == "cuda"]
    watch = load.ForeignLoad(gpus)
    try:
        fork = launch.may_fork(bool(gpus))
        cmd = launch.command(strategy, config, paths, store.port if store else 0, tb_run(strategy.name, variant),
                             fork=fork)
        hang = Path(config.out) / "hang" / stem  # the ranks' records of collectives, on a failure or stall
        shutil.rmtree(hang, ignore_errors=True)  # an earlier round's or attempt's are not this one's
        env = {**(launch.torchrun_env() if store else {}), **checked_env(workload_of(config)), HANG_DIR: str(hang)}
        outcome = launch.run_child(cmd, config.timeout, logs / f"{stem}.log", env=env, fork=fork)
    finally:
        if store:
            store.close()
    foreign_cpu, foreign_gpu = watch.stop()
    if outcome.returncode != 0 or not paths["result"].exists():
        first = None if outcome.timed_out or not store else launch.first_failure(paths["result"])
        outcome.error = first or outcome.error or "the child wrote no result"
        own = first is not None and not from_a_collective(first)  # a rank's own crash says it all
        if store and not own:  # where the ranks parted (a dying gloo rank's last words are in the log)
            log = logs / f"{stem}.log"
            if line := diagnose.explain(hang, strategy.world_size(config), log.read_text(errors="replace")
                                     if log.exists() else ""):
                outcome.error = f"{line} (records: {hang})"
        return _failed_row(strategy, variant, config, outcome), None
    shutil.rmtree(hang, ignore_errors=True)  # a stall that resolved itself: nothing to diagnose
    row = Row.from_dict(json.loads(paths["result"].read_text()))
    row.variant = variant
    row.details["phases_s"] = {**row.details.get("phases_s", {}), "launch": round(outcome.wall_s, 2)}
    row.foreign_cpu, row.foreign_gpu_pids = foreign_cpu, foreign_gpu
    if config.mutant.startswith(f"{strategy.name}:"):  # the row that carries an injected bug says so
        row.variant = ",".join(filter(None, [variant, f"mutant={config.mutant.split(':', 1)[1]}"]))
    return row, torch.load(paths["state"], weights_only=True)


def add_relative(rows: list[Row], baseline: Row | None) -> None:
    """speedup = samples/s over the baseline's (same run); efficiency = speedup / devices used."""
    if baseline is None or not baseline.samples_per_s:
        return
    for r in rows:
        if r.samples_per_s:
            r.speedup = r.samples_per_s / baseline.samples_per_s
            r.efficiency = r.speedup / r.world_size


def _folder(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def pair_rounds(rows: list[Row], timings: list[list[tuple]], baseline: bool) -> None:
    """--repeat: each row's speedup is the median over rounds of its samples/s over the same round's
    `single` (a paired ratio: drift between rounds cancels), its step times the medians of the rounds'."""
    base = timings[0] if baseline and rows and rows[0].status == "ok" else None
    for row, mine in zip(rows, timings, strict=True):
        if row.status != "ok":
            continue
        ran = [t for t in mine if t[0]]
        row.round_step_ms = [p50 for _, p50, _ in ran]
        if ran:
            row.samples_per_s = statistics.median(sps for sps, _, _ in ran)
            row.step_ms_p50 = statistics.median(row.round_step_ms)
            row.step_ms_p95 = statistics.median(p95 for _, _, p95 in ran)
        if base is not None:
            row.round_speedups = [sps / b[0] for (sps, _, _), b in zip(mine, base, strict=True) if sps and b[0]]
            if row.round_speedups:
                row.speedup = statistics.median(row.round_speedups)
                row.efficiency = row.speedup / row.world_size


BASELINE_DRIFT = 0.15  # `single`'s step moving more than this between rounds is flagged


def flag(rows: list[Row], baseline: bool = True) -> None:
    """Mark what cannot be right as measured, with what to do: a row measured while other processes
    loaded the machine; an efficiency above 100% (more than the devices can give: a slow baseline, or a
    cache effect, told apart by the spread of paired rounds); a baseline whose speed moved between rounds."""
    for r in rows:
        # a row that had its paired rounds is not told to have them again (a --repeat 3 run said so before)
        again = "re-run on a quiet machine" if len(r.round_speedups) > 1 else \
            "re-run with --repeat 3, or on a quiet machine"
        r.flags = []
        if r.status != "ok":
            continue
        if (r.foreign_cpu or 0.0) > load.NOISY:
            r.flags.append(f"noisy: other processes used {r.foreign_cpu:.0%} of the machine's CPU while it ran "
                           f"(more than {load.NOISY:.0%}); {again}")
        if r.foreign_gpu_pids:
            r.flags.append(f"noisy: other processes ({', '.join(map(str, r.foreign_gpu_pids))}) computed on its "
                           f"GPUs; {again}")
        if r.efficiency is not None and r.efficiency > 1.0 and r.strategy != BASELINE:
            low = min(r.round_speedups) / r.world_size if len(r.round_speedups) > 1 else None
            if low is None:
                r.flags.append(f"{r.efficiency:.0%} efficiency, more than {r.world_size} device(s) can give, from one "
                               f"measurement: noise or a slow baseline until paired rounds say otherwise; {again}")
            elif r.world_size == 1:  # one device doing single's work (a pass-through): above single is noise
                r.flags.append(f"{r.efficiency:.0%} efficiency on one device, doing what `single` does: noise "
                               f"between its runs and single's (paired rounds {low:.0%} and up)")
            elif low > 1.0:
                r.flags.append(f"real effect: {r.efficiency:.0%} efficiency in every one of {len(r.round_speedups)} "
                               f"paired rounds (lowest {low:.0%}), from splitting the batch on this hardware (a share "
                               "that fits the cache), not noise")
            else:
                r.flags.append(f"{r.efficiency:.0%} efficiency, but its paired rounds go down to {low:.0%}: within "
                               "its spread, noise")
        exposed = r.measured.exposed_comm_ms
        if exposed is not None and exposed < 0:  # a step with its all-reduces faster than one without them
            r.flags.append(f"exposed communication measured {exposed:.1f} ms: the step that synchronizes ran faster "
                           f"than the one that does not, which cannot be; noise between the two timings; {again}")
    base = rows[0] if baseline and rows and rows[0].strategy == BASELINE else None
    if base is not None and len(base.round_step_ms) > 1:
        moved = max(base.round_step_ms) / min(base.round_step_ms) - 1
        if moved > BASELINE_DRIFT:
            base.flags.append(f"its step moved {moved:.0%} between rounds (more than {BASELINE_DRIFT:.0%}): the "
                              "machine's speed changed during the run; each speedup is paired with its own "
                              "round's, but if rows disagree, re-run on a quiet machine")


def select_runs(config: RunConfig, names: list[str], baseline: bool = True, strict: bool = True) -> tuple[list, dict]:
    """Every (strategy, variant label, config) to run, `single` first when it is the baseline, and the
    strategies left out with the one-line reason of each. Under `all` (or, not `strict`, a scaling
    sweep's point) a strategy that cannot run this config (these devices, this batch, this model, its
    options) is left out and the rest run; a strategy the user named is refused with its reason
    (ConfigError, exit 2), as is every bad combination, before anything is started or written. A baseline
    over --memory-cap that no one named trains the shallow twin instead (judge/twin.py)."""
    workload = workload_of(config)
    model = functools.cache(lambda: workload.build_model(config.seed))  # built once, if a check needs it
    shapes = functools.cache(lambda: shape_model(config))  # on the meta device: the planner counts, at any size

    def may_skip(name: str) -> bool:  # a sweep's point, or one `all` took in; one the user named: refused
        return not strict or ("all" in names and name not in names)

    runnable, skipped = strategies.resolve(names, config.spec, workload, strict=strict)
    if baseline:
        runnable = [BASELINE] + [n for n in runnable if n != BASELINE]
    chosen = []
    for s in map(strategies.get, runnable):
        try:  # a check the meta device refused, run on a real copy: said in the row (RunConfig.real_copy)
            variants = [(label, dataclasses.replace(cfg, real_copy=why) if (why := s.validate(cfg)) else cfg)
                        for label, cfg in s.variants(config)]
        except ConfigError as e:  # a check that failed in the user's model (CheckFailed): skipped, even if named
            if s.name == BASELINE or not (may_skip(s.name) or isinstance(e, CheckFailed)):
                raise
            skipped[s.name] = re.sub(rf"^{s.name} cannot (run on \S+|train the .*? workload): ", "", str(e))
            continue
        if over := twin.over_cap(s.name, variants, shapes, config):
            if s.name == BASELINE and BASELINE not in names:  # the baseline no one named: its shallow twin instead
                entry, skipped[s.name] = twin.baseline(config, over, shapes)
                chosen += entry
                continue
            if s.name == BASELINE or not may_skip(s.name):
                raise ConfigError(f"{s.name}: {over}")
            skipped[s.name] = over
            continue
        chosen += [(s, label, cfg) for label, cfg in variants]
    considered = [s for s, _, _ in chosen] + [strategies.get(n) for n in skipped]
    taken = {f.name for s in considered for f in s.option_fields()}
    if untaken := [o for o in config.options if o not in taken]:  # a flag no strategy run here would read
        owners = [s.name for s in strategies.all_strategies() if untaken[0] in {f.name for f in s.option_fields()}]
        raise ConfigError(f"--{untaken[0].replace('_', '-')} is an option of {', '.join(owners)}, which is not "
                          f"run here ({', '.join(n for n in runnable if n != BASELINE) or BASELINE})")
    if config.port:
        launch.loopback_socket(config.port).close()  # a taken rendezvous port is bad input, found now
    if config.resume_from:  # missing, corrupt or for another model: refused now, not in a child
        checkpoint.check_fits(Path(config.resume_from), model(), f"the {config.workload} model")
    return chosen, skipped


def run_strategies(config: RunConfig, chosen: list[tuple], baseline: bool = True,
                   on_row: Callable[[list[Row]], None] = lambda rows: None) -> list[Row]:
    """Run the plan in turn; `on_row(rows so far)` after each, so an interrupted run keeps its rows."""
    chosen = list(chosen)  # a later pipeline row's entry takes the run's cut (below)
    out = Path(config.out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="parallel-"))
    rows: list[Row] = []
    ref = None
    blocks = chosen[0][2].twin_blocks if baseline and chosen else 0  # `single` on the twin: all judged there
    paired = baseline and bool(chosen) and chosen[0][0].name == BASELINE and not blocks  # single's speedups
    model = workload_of(chosen[0][2] if blocks else config).build_model(config.seed)  # what `single` trains
    initial, causes = model.state_dict(), cannot_match(model)  # dropout, BatchNorm: named in a mismatch
    rounds = max(1, config.repeat)
    timings: list[list[tuple]] = [[] for _ in chosen]  # per plan entry, per round: samples/s, step ms p50, p95
    relative = functools.partial(twin.relative, timings=timings) if blocks else \
        (lambda rows: add_relative(rows, rows[0] if paired and rows[0].status == "ok" else None))
    try:
        with make_progress() as progress:
            task = progress.add_task("strategies", total=len(chosen) * rounds)
            cuts: dict[str, list[int]] = {}  # one cut per stage count for every pipeline row of the run
            for i, (s, variant, cfg) in enumerate(chosen):
                progress.update(task, description=f"{s.name} {variant} ({s.launch}, {s.world_size(cfg)} dev)")
                if cuts:
                    cfg = dataclasses.replace(cfg, cuts={**cuts, **cfg.cuts})
                    chosen[i] = (s, variant, cfg)  # its repeat rounds too
                row, state = run_one(s, variant, cfg, work, logs)
                if cut := pipelines.result(row):  # a pipeline's stages
                    cuts.setdefault(f"{cut.balance}:{len(cut.bounds) - 1}", cut.bounds)
                if state is not None:
                    row.eval_loss = eval_loss(workload_of(cfg), state, config.seed)
                judged = row  # the run the verdict is on: the row's own, or its run on the shallow twin
                if baseline and s.name == BASELINE and state is not None:
                    ref = equivalence.Reference(initial, state, equivalence.curves(row), causes=causes)
                    if config.model and "dropout" not in causes:  # a model the tolerances were not measured
                        ref.noise = noise.own_noise(  # on: its own noise (not dropout's masks)
                            cfg, ref, rerun=lambda s, c: run_one(s, "noise", c, work, logs))
                    row.equivalence = Equivalence("baseline", 0.0, basis=equivalence.rule_for(s, cfg).basis)
                    row.twin_blocks, row.details = blocks, {**row.details, **(twin.facts(cfg) if blocks else {})}
                elif row.status == "ok" and blocks and ref is not None:
                    progress.update(task, description=f"{s.name} {variant} on the {twin.NAME}")
                    judged = twin.judge(s, variant, cfg, blocks, ref, row,
                                        lambda v, c, s=s: run_one(s, v, c, work, logs))
                elif row.status == "ok":
                    row.equivalence = equivalence.judge(s, cfg, ref, row, state)
                if row.equivalence.verdict == "not-expected" and rows and rows[0].eval_loss and judged.eval_loss:
                    ratio = judged.eval_loss / rows[0].eval_loss
                    row.equivalence.reason += (f"; converged instead: eval loss {judged.eval_loss:.4f} vs "
                                               f"single {rows[0].eval_loss:.4f} ({ratio:.2f}x), same samples")
                rows.append(row)
                timings[i].append((row.samples_per_s, row.step_ms_p50, row.step_ms_p95))
                profiling.write_scalars(out / "tb", row)
                relative(rows)
                flag(rows, baseline)  # each row saved with its flags: a stopped run's rows carry theirs
                on_row(rows)
                progress.advance(task)
            for k in range(1, rounds):  # the same list again: timing only, no profile, logs per round
                for i, (s, variant, cfg) in enumerate(chosen):
                    progress.update(task, description=f"round {k + 1}/{rounds}: {s.name} {variant}")
                    again, _ = run_one(s, variant, dataclasses.replace(cfg, profile=False), work,
                                       _folder(logs / f"round-{k + 1}"))
                    timings[i].append((again.samples_per_s, again.step_ms_p50, again.step_ms_p95)
                                      if again.status == "ok" else (None, None, None))
                    if again.foreign_cpu is not None:  # the worst round is what the row was measured under
                        rows[i].foreign_cpu = max(rows[i].foreign_cpu or 0.0, again.foreign_cpu)
                        rows[i].foreign_gpu_pids = sorted({*rows[i].foreign_gpu_pids, *again.foreign_gpu_pids})
                    progress.advance(task)
                pair_rounds(rows, timings, paired)
                flag(rows, baseline)
                on_row(rows)
            if blocks:  # over the fastest that matched, of those flag() left unflagged (each row flagged above)
                twin.relative(rows, timings)
                on_row(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
