"""The shallow twin: a comparison for a model that `single` cannot hold on one device.

`single` is every row's reference, for the verdict and for the speedup. When the planner puts it over
--memory-cap (`over_cap`), the run goes on without it at full size (compare.select_runs, compare.run_strategies):

    the model       every strategy that fits, timed and measured as always (ms, memory, bytes sent)
    its twin        the same model with 1 or 2 blocks (every width, the vocabulary, the options, the data
                    and the seed as they are): `single` trains it, and every strategy that ran trains it
                    again (no profile, no extra measurements), judged against that `single`

The twin takes 2 blocks where the model has more and the planner puts `single` on 2 under the cap, else 1:
two blocks keep a block-to-block hand-off (where pipelines cut, what FSDP shards group by group, what
tensor parallelism repeats), which one block does not have. A model whose depth cannot be set (no
`Workload.depth_arg`, no factory argument `layers`/`n_layer`, no Hugging Face num_hidden_layers) has no
twin: its rows run and say that nothing judged them.

Speedups are over the fastest row on several devices that matched on the twin (`relative`; each row
names it in `speedup_over`): what a user choosing a layout for a model that needs several devices wants
to know is how each layout compares with the best one that trains correctly. A speedup over the twin's
`single` would divide the whole model's samples/s by a smaller model's, and efficiency (speedup per
device) needs one device's throughput on the whole model, which cannot be measured: it is left empty.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import equivalence
from parallel.loop.results import Equivalence, Row, file_stem
from parallel.models.usermodel import shape_model, workload_of
from parallel.models.workloads import eval_loss
from parallel.world.errors import ConfigError

NAME = "shallow twin"
DEPTHS = (2, 1)  # blocks the twin may have, most first
NO_TWIN = "no shallow twin: "  # how a skipped `single`'s reason says why nothing is judged


def over_cap(name: str, variants: list, model: Callable, config: RunConfig) -> str:
    """Under --memory-cap: why the planner says a variant of `name` does not fit ("" if all fit or the
    planner has no layout for it). `model()`: the run's model on the meta device, built on first use."""
    if not config.memory_cap_mb:
        return ""
    from parallel.plan import local  # only under a cap: no planner at every run's start

    for _, cfg in variants:
        if not local.checked(name, cfg):
            continue
        need = local.need(name, cfg, model())
        if need and need["total"] > config.memory_cap_mb * 2**20:
            return (f"the planner puts it at {need['total'] / 2**20:.1f} MiB a device (model state "
                    f"{need['model_state'] / 2**20:.1f}, activations {(need['activations'] or 0) / 2**20:.1f}), over "
                    f"--memory-cap {config.memory_cap_mb:g} MiB")
    return ""


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def baseline(config: RunConfig, over: str, model: Callable) -> tuple[list[tuple], str]:
    """`single` on the shallow twin, as the plan's first entry (labelled "twin=B"), and what the run says
    of `single`, left out at full size because of `over`; no entry where no twin can be built or none
    fits the cap. `model()`: the whole model on the meta device."""
    single, full = strategies.get(strategies.BASELINE), _params(model())
    why = f"the model has no more than {DEPTHS[-1]} block"
    for blocks in DEPTHS:
        cfg = dataclasses.replace(config, twin_blocks=blocks)
        try:
            twin = shape_model(cfg)
            if _params(twin) >= full:  # as deep as the model: not a twin
                continue
            if too_big := over_cap(single.name, [("", cfg)], lambda twin=twin: twin, cfg):
                why = f"with {blocks} block{'s' if blocks > 1 else ''}, {too_big}"
                continue
            single.validate(cfg)
        except ConfigError as e:
            return [], f"{over}; {NO_TWIN}{e}"
        return [(single, f"twin={blocks}", cfg)], f"{over}; it trains the {NAME} instead (twin={blocks})"
    return [], f"{over}; {NO_TWIN}{why}"


def facts(cfg: RunConfig) -> dict:
    """What `single`'s row on the twin records of it (its details): blocks and parameters beside the
    model's, and the planner's figure for `single` on it."""
    twin, whole = shape_model(cfg), shape_model(dataclasses.replace(cfg, twin_blocks=0))
    out = {"twin_blocks": cfg.twin_blocks, "twin_params": _params(twin), "model_params": _params(whole)}
    if cfg.memory_cap_mb:
        from parallel.plan import local

        out["twin_planner_bytes"] = local.need("single", cfg, twin)["total"]
    return out


def judge(strategy, variant: str, cfg: RunConfig, blocks: int, ref, row: Row, run: Callable) -> Row | None:
    """Judge `row`, a strategy's run of the whole model, by the same strategy on the twin of `blocks`
    against `ref` (single's run of it): `run(variant, config)` runs it (compare.run_one). Sets
    row.equivalence and row.twin_blocks; a run that fails on the twin fails the row. Returns the twin's row
    (with its eval loss where it is judged by where it converged), or None where the strategy cannot run on
    the twin (unjudged, saying why)."""
    on = dataclasses.replace(cfg, twin_blocks=blocks, cuts={}, profile=False, extras=False, checkpoint_every=0,
                             resume=False, resume_from="", fail_at_step=-1, hang_rank=-1)  # for its verdict only
    row.twin_blocks = blocks
    try:
        strategy.validate(on)
    except ConfigError as e:
        row.equivalence = Equivalence("unchecked", reason=f"not judged: it cannot run on the {NAME} ({e})")
        return None
    label = ",".join(filter(None, [variant, f"twin={blocks}"]))
    mine, state = run(label, on)
    if mine.status != "ok" or state is None:
        row.status = mine.status
        log = f"logs/{file_stem(row.strategy, label)}.log"
        row.error = f"its run on the {NAME} {mine.status}: {mine.error} (log: {log})"
        return None
    row.equivalence = equivalence.judge(strategy, on, ref, mine, state)
    if row.equivalence.verdict == "not-expected":  # judged by where it converged: against the twin's `single`
        mine.eval_loss = eval_loss(workload_of(on), state, cfg.seed)
    return mine


def relative(rows: list[Row], timings: list[list[tuple]] | None = None) -> None:
    """Speedups where `single` ran only as the twin: each row's samples/s over the fastest row on several
    devices that matched (of those not flagged, where there is one), named in speedup_over; with --repeat,
    the median of the rounds paired with that row's (`timings`: per row, per round, samples/s first).
    No efficiency, and no speedup where nothing matched."""
    timed = [r for r in rows if r.status == "ok" and r.samples_per_s and r.equivalence.verdict != "baseline"]
    matched = [r for r in timed if r.world_size > 1 and r.equivalence.verdict == "match"]
    base = max([r for r in matched if not r.flags] or matched, key=lambda r: r.samples_per_s, default=None)
    rounds = dict(zip(map(id, rows), timings or [], strict=False))
    for r in rows:
        r.speedup = r.efficiency = None
        r.speedup_over, r.round_speedups = "", []
    for r in timed if base else []:
        r.speedup, r.speedup_over = r.samples_per_s / base.samples_per_s, base.label
        pairs = zip(rounds.get(id(r), []), rounds.get(id(base), []), strict=False)
        paired = [mine[0] / theirs[0] for mine, theirs in pairs if mine[0] and theirs[0]]
        if len(paired) > 1:  # --repeat: the median of the paired rounds, as over `single` (compare.pair_rounds)
            r.round_speedups, r.speedup = paired, statistics.median(paired)


def judged_rows(rows: list[Row]) -> list[Row]:
    """The rows of the whole model whose verdict came from the twin."""
    return [r for r in rows if r.twin_blocks and r.equivalence.verdict != "baseline"]


def title(rows: list[Row], skipped: dict | None) -> str:
    """The main table's title where `single` did not fit ("" otherwise)."""
    if "single" not in (skipped or {}):
        return ""
    if any(r.twin_blocks and r.equivalence.verdict == "baseline" for r in rows):
        return f"Every strategy that fits, judged against `single` on the {NAME}"
    return "Every strategy that fits; `single` does not, so none is judged"


def notes(rows: list[Row], skipped: dict | None) -> list[str]:
    """The report's lines where `single` did not fit: what the twin is, which rows it judged, which it
    could not, and what the speedups are over; [] for an ordinary run."""
    if "single" not in (skipped or {}):
        return []
    base = next((r for r in rows if r.equivalence.verdict == "baseline" and r.twin_blocks), None)
    if base is None:
        return [f"not judged: `single` does not fit one device, and there is {NO_TWIN}"
                f"{skipped['single'].split(NO_TWIN, 1)[-1]}; no row is checked against one device",
                "speedup: none (no row is judged); eff.: none; ms, memory and bytes are the whole model's"]
    d, judged = base.details, judged_rows(rows)
    size = f", {d['twin_params'] / 1e6:.2f}M params of {d['model_params'] / 1e6:.2f}M" if "twin_params" in d else ""
    blocks = f"{base.twin_blocks} block{'s' if base.twin_blocks > 1 else ''}"
    unjudged = [r for r in judged if r.equivalence.verdict == "unchecked"]
    who = "every other row" if not unjudged else ", ".join(r.label for r in judged if r not in unjudged) or "no row"
    out = [f"{NAME}: `single` does not fit one device, so it trained the {NAME}: the same model with {blocks}"
           f"{size} (same widths, vocabulary, options, data, seed); {who} trained it again, "
           "judged there against it; ms, memory and bytes are the whole model's (single's row: the twin's)"]
    out += [f"{r.label}: {r.equivalence.reason}" for r in unjudged]
    over = next((r.speedup_over for r in rows if r.speedup_over), "")
    out.append(f"speedup: samples/s over {over}'s, the fastest on several devices that matched (no one-device run "
               "of the whole model fits); eff.: none; equivalence: error/tolerance on the twin" if over else
               "speedup: none, no row on several devices matched on the twin; equivalence: error/tolerance on the twin")
    return out
