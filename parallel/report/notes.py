"""The lines under the report's tables: the notes a reader must know to read them right (at most about ten
on a quiet machine, folded; their full text in details.txt and --wide), the cost model's lines, and the
verdict: which strategy, on this hardware, from this run."""

from __future__ import annotations

import re
import statistics
from pathlib import Path

from parallel.judge import twin
from parallel.loop.results import Row
from parallel.strategies import BASELINE

# Notes: at most about ten lines on a quiet machine; everything else in details.txt ---------------------


def _short(reason: str) -> str:
    """A skip reason's first clause: 'needs 4 devices or more (dp 2 x tp 2), cpu:2 has 2' -> 'needs 4 ...'."""
    first = re.split(r"[:;](?=\s)|, (?![^()]*\))", reason, maxsplit=1)[0]  # not a name's colon (file.py:factory)
    return re.sub(r"(\d+) devices or more", r"\1+ devices", re.sub(r"^it (has )?|\s*\([^()]*\)$", "", first.strip()))


def skipped_in_full(skipped: dict) -> list[str]:
    """Every skipped strategy with its whole reason, a line each (--wide, details.txt, `devices`)."""
    return [f"{name} skipped: {why}" for name, why in skipped.items()]


def skipped_line(skipped: dict) -> str | None:
    if not skipped:
        return None
    by: dict[str, list[str]] = {}
    for name, why in skipped.items():
        by.setdefault(_short(why), []).append(name)
    return "skipped: " + "; ".join(f"{', '.join(names)} ({why})" for why, names in by.items())


def _span(values: list[float]) -> str:
    lo, hi = round(min(values) * 100), round(max(values) * 100)
    return f"{lo}%" if lo == hi else f"{lo}-{hi}%"


def flag_lines(rows: list[Row]) -> list[str]:
    """Flags, folded: every row measured under load in one line; the same kind of doubt about several rows
    in one line; other flags one line each (their full text is in details.txt)."""
    out = []
    loaded = [r for r in rows if any(f.startswith("noisy: other processes used") for f in r.flags)]
    if loaded:
        rounds = max((len(r.round_speedups) for r in rows), default=0)
        again = "re-run on a quiet machine" if rounds > 1 else "--repeat 3 pairs rounds, or re-run on a quiet machine"
        measured = len([r for r in rows if r.status == "ok"])
        who = f"all {measured} rows" if len(loaded) == measured else f"{len(loaded)} of {measured} rows" + (
            f" ({', '.join(r.label for r in loaded)})" if len(loaded) <= 3 else "")
        out.append(f"noisy: {who} measured while other processes used {_span([r.foreign_cpu for r in loaded])} "
                   f"of the CPU; {again}")
    over = [r for r in rows if any("from one measurement" in f for f in r.flags)]
    if over:
        out.append(", ".join(f"{r.label} {r.efficiency:.0%}" for r in over) + " efficiency from one measurement: "
                   "noise or a slow baseline (--repeat 3 tells)")
    folded = {id(r) for r in loaded + over}
    for r in rows:
        for f in r.flags:
            if (id(r) in folded and (f.startswith("noisy: other processes used") or "from one measurement" in f)):
                continue
            out.append(f"{r.label}: {f.split('; re-run')[0]}")
    return out


def replica_lines(rows: list[Row]) -> list[str]:
    """--check-replicas: each row's first step whose copies parted (beside the oracle's verdict, which
    judges the end against one device), and one line for the rows checked in which all agreed, naming
    those whose ranks share nothing to compare (every tensor a shard or a stage of its own)."""
    out = [f"{r.label}: {r.details['replicas_diverged']}" for r in rows if r.details.get("replicas_diverged")]
    quiet = [r for r in rows if "replicas_checked" in r.details and not r.details.get("replicas_diverged")]
    agreed = [r.label for r in quiet if r.details["replicas_checked"]]
    apart = [r.label for r in quiet if not r.details["replicas_checked"]]
    parts = ([f"every replica agreed at every step ({', '.join(agreed)})"] if agreed else []) + \
        ([f"no two ranks hold a tensor alike in {', '.join(apart)}: nothing to compare"] if apart else [])
    return out + ([f"--check-replicas: {'; '.join(parts)}"] if parts else [])


def first_steps(rows: list[Row]) -> str | None:
    """A run with no warm-up (a shape on CPUs: steps of seconds) times its first step too: how much slower
    that step was than the later ones, over the rows, from their own step times."""
    ratios = sorted(r.step_ms[0] / statistics.median(r.step_ms[1:]) for r in rows
                    if r.status == "ok" and len(r.step_ms) > 1 and statistics.median(r.step_ms[1:]) > 0)
    if not ratios:
        return None
    return (f"no warm-up: each step time includes the first step, which took {statistics.median(ratios):.0%} of "
            f"a later one's time (median; {_span(ratios)} over {len(ratios)} rows); --warmup 1 leaves it out")


def clip_line(rows: list[Row], run: dict) -> str | None:
    """How often the clip bit in `single`'s run, and whether every row's global gradient norm (judged with
    its losses) followed single's: the line that says the clip was tested, not only switched on."""
    base = next((r for r in rows if r.equivalence.verdict == "baseline" and r.grad_norms), None)
    if base is None or not run.get("clip_norm"):
        return None
    norms = [n for curve in base.grad_norms.values() for n in curve]
    over = sum(n > run["clip_norm"] for n in norms)
    judged = [r for r in rows if r.grad_norms and r.equivalence.verdict in ("match", "mismatch")]
    off = [r.label for r in judged if "grad_norm" in r.equivalence.reason]
    return (f"clip: single's gradient norm exceeded --clip-norm {run['clip_norm']:g} in {over} of {len(norms)} "
            f"steps (largest {max(norms):.3g}); " + (f"{len(judged)} rows' norms judged with their losses, "
                                                     + (f"off in {', '.join(off)}" if off else "all within the rule")
                                                     if judged else "no other row to judge"))


def update_line(rows: list[Row]) -> str | None:
    """The optimiser's update alone (loop/clipping.py's hooks), median ms a step by row: what sharding the
    optimiser state (ZeRO, FSDP) spreads over the ranks, each stepping its 1/N."""
    timed = [(r.label, r.update_ms_p50) for r in rows if r.update_ms_p50 is not None and not r.error]
    if len(timed) < 2:
        return None
    return "update: the optimiser's step alone, median ms: " + ", ".join(f"{k} {v:.3g}" for k, v in timed)


def notes(rows: list[Row], environment: dict, skipped: dict | None = None) -> list[str]:
    """What a reader must know to read the table right, in as few lines as it takes."""
    out = [f"{r.label} {r.status}: {r.error.splitlines()[0]}"  # the log: logs/round-k/ with --repeat
           + ("" if "log:" in r.error else f" (its traceback: {r.stem}.log in logs/)") for r in rows if r.error]
    out += [f"{r.label} mismatch: {r.equivalence.reason}" for r in rows if r.equivalence.verdict == "mismatch"]
    out += replica_lines(rows)
    out += flag_lines(rows)
    if line := skipped_line(skipped or {}):
        out.append(line)
    for r in rows:
        if r.equivalence.verdict == "not-expected":
            ratio = ""
            base = next((b for b in rows if b.equivalence.verdict == "baseline"), None)
            if r.twin_blocks:  # single's eval loss is the twin's: the row's run on the twin against it
                ratio = f"; on the {twin.NAME}: {r.equivalence.reason.partition('converged instead: ')[2]}".rstrip(": ")
            elif base and base.eval_loss and r.eval_loss:
                ratio = f"; eval loss {r.eval_loss / base.eval_loss:.2f}x single's"
            why = r.details.get("not_expected") or "asynchronous, not the same training as one device"
            out.append(f"{r.label}: {why}{ratio}")
    judged: dict[str, list[str]] = {}  # rows judged by one looser rule are named together
    for r in rows:
        if r.equivalence.basis and r.equivalence.basis != "fp32 rule" and r.equivalence.verdict != "baseline":
            judged.setdefault(r.equivalence.basis, []).append(r.label)
    out += [f"{', '.join(labels)}: judged by {basis}" for basis, labels in judged.items()]
    copies: dict[str, list[str]] = {}  # the checks that ran on a real copy, by the meta device's refusal
    for r in rows:
        if why := r.details.get("checked_on_a_real_copy"):
            copies.setdefault(why, []).append(r.label)
    out += [f"{', '.join(labels)}: checked on a real copy of the model in the parent, where the meta device "
            f"refused ({why})" for why, labels in copies.items()]
    if (run := environment.get("run") or {}).get("read_per_rank"):
        out.append(f"--data {Path(run['read_per_rank']).name} is memory-mapped, each rank reading only its own "
                   f"rows: every step all-reduces its count of real targets (one float64, in sent/step)")
    if run.get("real_tokens_per_share"):
        low, high = run["real_tokens_per_share"]
        mean = run["real_tokens_mean"]
        source = "--data's -100 targets" if run["tokens"] == "file" else f"--tokens {run['tokens']}"
        out.append(f"uneven tokens ({source}): a 1/{run['shares']} share of a batch held {low:,} to "
                   f"{high:,} real tokens (mean {mean:,.0f}); " + (
                       f"your model returns its own mean loss, which the harness cannot weigh: averaged over "
                       f"such shares a token counts {mean / high:.2f}x to {mean / low:.2f}x its weight in the "
                       "global token mean, so a split batch trains differently from one device (docs/loss.md: "
                       "return the logits, or the sum and the count)" if run.get("own_mean_loss") else
                       "every strategy is given the global token mean's share (docs/loss.md)"))
    if line := clip_line(rows, environment.get("run") or {}):
        out.append(line)
    if line := update_line(rows):
        out.append(line)
    if (environment.get("run") or {}).get("warmup") == 0 and (line := first_steps(rows)):
        out.append(line)
    kind = environment["device_kind"]
    if kind == "virtual":
        out.append(f"simulated: {environment['devices']} is virtual devices on {environment['cpu']['cores']} CPU "
                   "core(s): speedups are this CPU's, not a GPU's" + (" (more devices than cores)" if
                                                                    environment.get("oversubscribed") else ""))
    elif kind == "shared":
        out.append(f"shared: {environment['devices']} is ranks taking turns on one GPU (gloo): every CUDA path is "
                   "checked; speedups show what splitting costs")
    if why := environment.get("gpus_unusable"):
        out.append(f"GPUs not used: {why}")
    if kinds := sorted({r.device_kind for r in rows} & {"serial", "pass-through"}):
        out.append(" / ".join(kinds) + ": one device, nothing in parallel; the row costs the strategy's machinery")
    out += twin.notes(rows, skipped) or ["speedup: samples/s over single's (this run); eff.: speedup/devices; "
                                         "equivalence: error/tolerance"]
    return out



# The cost model's lines ---------------------------------------------------------------------------------


def cost_lines(model: dict | None) -> list[str]:
    if not model or "projection" not in model:  # not calibrated (a shallow twin's run): the projection alone
        return memory_lines(model or {})
    ab = (f"all-reduce alpha {model['alpha_us']:.0f} us, beta {model['beta_ns_per_byte']:.2f} ns/B, "
          if model["alpha_us"] is not None else "")
    proj = model["projection"]
    gpus = ", ".join(f"{n} GPUs {us:.3g} us" for n, us in proj["us_by_gpus"].items())
    return [f"pred. ms: the cost model calibrated in this run ({ab}copy {model['copy_GB_per_s']:.1f} GB/s, compute "
            "measured per batch size): compute on one device's share + communication not hidden + bubble.",
            f"Projection, not measured: all-reduce of these gradients at the published {proj['busbw_GB_per_s']:.0f} "
            f"GB/s NCCL bus bandwidth (8xH200): {gpus} (optimistic across nodes)."] + memory_lines(model) + \
        ([model["planner"]["note"]] if "planner" in model else [])


def memory_lines(model: dict) -> list[str]:
    """--project-params: model state per GPU by ZeRO stage, and from how many GPUs it fits."""
    mem = model.get("memory_projection")
    if not mem:
        return []
    out = [f"Projection, not measured: {mem['what']}, for {mem['params']:.3g} parameters on "
           f"{mem['capacity_GiB']:g} GiB GPUs:"]
    for stage, gib in mem["GiB_by_stage"].items():
        fits = mem["fits_from_gpus"][stage]
        where = f"fits from {fits} GPU{'s' if fits > 1 else ''}" if fits else "never fits, at any count"
        out.append(f"  {stage}: " + ", ".join(f"{n} GPUs {g:.1f} GiB" for n, g in gib.items()) + f"; {where}")
    return out


# The verdict --------------------------------------------------------------------------------------------


def _doubted(r: Row) -> bool:
    """A row whose speed the flags question: measured under load, or more than its devices can give."""
    return any(not f.startswith("real effect") for f in r.flags)


def advice(rows: list[Row]) -> list[str]:
    """Which strategy when, on this hardware, from this run's numbers (no sentence is fixed in advance).
    Only rows on several devices that trained like one device compete; `single` never does. The verdict
    is withheld when the measurements behind it are in doubt, and says what backs it when it is given:
    one measurement, or the median of paired rounds; rows it cannot tell apart are named with it."""
    ok = [r for r in rows if r.status == "ok" and r.speedup is not None and r.world_size > 1 and r.strategy != BASELINE]
    if not ok:
        if any(r.status == "ok" and r.world_size == 1 and r.strategy != BASELINE for r in rows):
            return ["One device: nothing here runs in parallel, so there is no layout to choose; the rows show what "
                    "each strategy's machinery costs against `single` (cuda:0x2 shares one GPU between 2 ranks)."]
        return []
    exact = [r for r in ok if r.equivalence.verdict == "match"]
    doubted = [r for r in ok if _doubted(r)]
    over = next((r.speedup_over for r in ok if r.speedup_over), "")  # speedups over a row: `single` did not fit
    out, named = [], set()  # named: rows the verdict has given already (the least slow and its ties)
    if not exact:
        out.append("No strategy on several devices trained like one device here: no fastest to name.")
    elif len(doubted) * 2 > len(ok):
        out.append(f"Withheld: {len(doubted)} of {len(ok)} rows are noisy or flagged, so their order is not "
                   "this hardware's; re-run on a quiet machine (with --repeat 3 for paired rounds).")
    else:
        clean = [r for r in exact if not _doubted(r)] or exact
        best = max(clean, key=lambda r: r.speedup)
        rounds = len(best.round_speedups)
        if rounds > 1:
            backed = f"median of {rounds} paired rounds, {min(best.round_speedups):.2f}-{max(best.round_speedups):.2f}"
            lo = min(best.round_speedups)
            ties = [r for r in clean if r is not best and len(r.round_speedups) > 1 and max(r.round_speedups) >= lo]
        else:
            backed = "one measurement"
            ties = [r for r in clean if r is not best and r.speedup >= 0.9 * best.speedup]
        noise = best.equivalence.basis.startswith("this model's own")  # noise.own_noise's rule
        like = "like one device, within the model's own rounding noise" if noise else "exactly like one device"
        like += f" on the {twin.NAME}" if over else ""
        if over:  # no one-device speed to be faster than: the fastest's own, which the speedups are over
            out.append(f"Fastest that trains {like}: {best.label}, {best.samples_per_s:,.0f} samples/s on "
                       f"{best.world_size} devices ({backed}); the speedups are over its samples/s.")
            named = {id(r) for r in (best, *ties)}
        elif best.speedup < 1:
            out.append(f"None trains {like} faster than one device here; the least slow: {best.label}, "
                       f"{best.speedup:.2f}x ({backed}).")
            named = {id(r) for r in (best, *ties)}
        else:
            out.append(f"Fastest that trains {like}: {best.label}, {best.speedup:.2f}x on {best.world_size} "
                       f"devices ({backed}).")
        if ties:
            out.append("Not told apart from it by this run: " + ", ".join(f"{r.label} {r.speedup:.2f}x" for r in ties)
                       + (" (their rounds overlap)." if rounds > 1 else " (within 10%, from one measurement)."))
        for r in ok:
            if r.equivalence.verdict == "not-expected" and r.speedup > best.speedup and not _doubted(r):
                out.append(f"Faster still: {r.label}, {r.speedup:.2f}x, but not the same training.")
    slower = [r for r in ok if r.speedup < 1 and not _doubted(r) and id(r) not in named]
    if slower:
        listed = ", ".join(f"{r.label} {r.speedup:.2f}x" for r in slower)
        out.append(f"{f'Slower than {over}' if over else 'Slower still' if named else 'Slower than one device here'}: "
                   f"{listed}.")
    for r in ok:
        m = r.measured
        if m.exposed_comm_ms is not None and m.exposed_comm_ms >= 0 and r.step_ms_p50 and not _doubted(r):
            out.append(f"{r.label}: {m.exposed_comm_ms / r.step_ms_p50:.0%} of each step is communication not "
                       f"hidden behind compute ({m.exposed_over_allreduce:.2f}x a bare all-reduce).")
    return out
