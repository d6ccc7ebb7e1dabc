"""The report: a rich table on the terminal, beside results.json / results.csv."""

from __future__ import annotations

import dataclasses

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from parallel.results import Row

VERDICT_STYLE = {"match": "green", "baseline": "cyan", "mismatch": "bold red", "not-expected": "yellow",
                 "unchecked": "dim"}


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _fmt(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _set(measured) -> dict:
    return {k: v for k, v in dataclasses.asdict(measured).items() if v is not None}


def table(rows: list[Row], environment: dict) -> Table:
    batch = rows[0].global_batch if rows else "?"
    t = Table(title=f"{batch} samples/step on {environment['devices']} ({environment['device_kind']})",
              title_justify="left")
    for col in ["strategy", "launch", "devices", "ms p50 (p95)", "pred. ms", "samples/s", "speedup", "eff.", "peak mem",
                "comm/step (pred.)", "loss", "eval loss", "equivalence", "status"]:
        t.add_column(col, justify="left" if col in ("strategy", "launch", "devices", "equivalence") else "right",
                     no_wrap=col in ("strategy", "ms p50 (p95)", "equivalence"))
    for r in rows:
        eq = r.equivalence
        verdict = f"[{VERDICT_STYLE.get(eq.verdict, '')}]{eq.verdict}[/]"
        if eq.ratio is not None:
            verdict += f" {eq.ratio:.2g}"
        p50 = "-" if r.step_ms_p50 is None else f"{r.step_ms_p50:.1f} ({r.step_ms_p95:.1f})"
        speedup = _num(r.speedup, ".2f")
        if len(r.round_speedups) > 1:  # --repeat: the median of the paired rounds, and their range
            speedup += f" [{min(r.round_speedups):.2f}-{max(r.round_speedups):.2f}]"
        t.add_row(r.label, r.launcher, f"{r.world_size} {r.device_kind}", p50, _num(r.step_ms_predicted, ".1f"),
                  _num(r.samples_per_s, ",.0f"), speedup, _num(r.efficiency, ".0%"),
                  _bytes(r.peak_mem_bytes), f"{_bytes(r.comm_bytes_per_step)} ({_bytes(r.comm_bytes_predicted)})",
                  _num(r.final_loss, ".4f"), _num(r.eval_loss, ".4f"), verdict,
                  (r.status if r.status == "ok" else f"[bold red]{r.status}[/]")
                  + (" [yellow]noisy[/]" if any(f.startswith("noisy") for f in r.flags) else "")
                  + (" [yellow]flag[/]" if any(not f.startswith("noisy") for f in r.flags) else ""))
    return t


def notes(rows: list[Row], environment: dict, skipped: dict | None = None) -> list[str]:
    """What a reader must know to read the numbers right on this hardware."""
    out = [f"[red]{r.label} {r.status}: {r.error}[/]" for r in rows if r.error]
    out += [f"[yellow]{r.label}: {f}[/]" for r in rows for f in r.flags]
    out += [f"{name} skipped: {why}" for name, why in (skipped or {}).items()]
    out += [f"{r.label}: {r.equivalence.reason}" for r in rows if r.equivalence.verdict == "not-expected"]
    out += [f"[red]{r.label} mismatch: {r.equivalence.reason}[/]" for r in rows
            if r.equivalence.verdict == "mismatch"]
    if any(r.equivalence.ratio is not None for r in rows):
        out.append("equivalence: every tensor and every step's loss against `single`'s, each within its own "
                   "tolerance; the number is the largest difference over its tolerance (above 1: mismatch). "
                   "Evidence that it catches real bugs: python -m parallel mutants")
    judged: dict[str, list[str]] = {}  # rows judged by one looser rule are named together
    for r in rows:
        if r.equivalence.basis and r.equivalence.basis != "fp32 rule" and r.equivalence.verdict != "baseline":
            judged.setdefault(r.equivalence.basis, []).append(r.label)
    out += [f"{', '.join(labels)}: judged by {basis}" for basis, labels in judged.items()]
    out += [f"{r.label}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in {**r.details, **_set(r.measured)}.items())
            for r in rows if r.details]
    out += [f"{r.label} losses, first -> last step: " + ", ".join(f"{k} {v[0]:.4f} -> {v[-1]:.4f}"
                                                                 for k, v in r.loss_parts.items())
            for r in rows if r.loss_parts]
    out += _reduce_scatter_caveat(rows) + pipeline_gaps(rows)
    if environment["device_kind"] == "virtual":
        cpu = environment["cpu"]
        out.append(f"Simulated: {environment['devices']} = virtual devices sharing {cpu['cores']} CPU core(s) "
                   f"({environment['threads_per_device']} thread(s) each); speedups show what splitting "
                   "the work costs and saves on this CPU, not what GPUs would do.")
        if environment.get("oversubscribed"):
            out.append("Oversubscribed: more virtual devices than cores; times include contention.")
    if why := environment.get("gpus_unusable"):
        out.append(f"GPUs not used: {why}.")
    if environment["device_kind"] == "shared":
        out.append(f"Shared: {environment['devices']} = {environment['devices'].rpartition('x')[2]} ranks on one GPU, "
                   "talking over gloo (nccl refuses two ranks on one device): every CUDA path runs on a real GPU and "
                   "the oracle checks it there, but the ranks take turns on it, so speedups show the cost of "
                   "splitting the work, not what several GPUs would do.")
    if any(r.device_kind == "pass-through" for r in rows):
        out.append("pass-through: the strategy cannot split work on this hardware and just runs the module.")
    if any(r.device_kind == "serial" for r in rows):
        out.append("serial: one device, so nothing runs in parallel: the row costs the strategy's machinery "
                   "(replicas, hooks, collectives of one) against `single`, and its speedup cannot pass 1.")
    kinds = {r.peak_mem_kind for r in rows if r.peak_mem_kind}
    if "process_peak_rss" in kinds:
        out.append("peak mem on CPU is the peak resident memory of rank 0's process (torch itself included); "
                   "every rank's and worker's is in the details, with the model state each device holds.")
    out.append("speedup: samples/s over `single` on one device of the same list, measured in this run; "
               "eff. = speedup / devices.")
    if rounds := max((len(r.round_speedups) for r in rows), default=0):
        out.append(f"--repeat {rounds}: every strategy ran {rounds} times, in interleaved rounds; speedup is the "
                   "median of each round's samples/s over that round's `single` [min-max over the rounds], ms "
                   "p50 the median of the rounds' (p95: the first round's); equivalence judged on the first round.")
    return out


def _largest(v):
    """A per-rank list's largest entry (ranks that did not measure give None), or the value itself."""
    if isinstance(v, list):
        v = [x for x in v if x is not None]
        return max(v) if v else None
    return v


def sharding_table(rows: list[Row]) -> Table | None:
    """Model state per rank by kind and bytes per step by collective, for the sharded strategies (and
    DDP, the unsharded reference), beside the ZeRO paper's figures: rows whose details carry them."""
    kinds = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
    chosen = [r for r in rows if r.status == "ok" and (r.strategy == "ddp" or set(kinds) & set(
        r.details.get("bytes_per_step_by_collective", ())))]
    if not any("bytes_per_step_by_collective" in r.details for r in chosen):
        return None
    t = Table(title="Sharded data parallel: model state per rank (largest rank) and bytes sent per step",
              title_justify="left")
    for col in ["strategy", "params", "grads", "optimizer", "model state", "ZeRO formula",
                *[k.replace("_", "-") for k in kinds], "sent (pred.)", "gathered peak"]:
        t.add_column(col, justify="left" if col == "strategy" else "right", no_wrap=col == "strategy")
    for r in chosen:
        d = r.details
        sent = d.get("bytes_per_step_by_collective") or {"all_reduce": r.comm_bytes_per_step}
        t.add_row(r.label, *(_bytes(_largest(d.get(f"{k}_per_rank"))) for k in ("param_bytes", "grad_bytes",
                                                                                "optimizer_state_bytes")),
                  _bytes(_largest(d.get("model_state_bytes_per_device"))), _bytes(d.get("zero_formula_bytes")),
                  *(_bytes(sent.get(k)) if sent.get(k) else "-" for k in kinds),
                  f"{_bytes(r.comm_bytes_per_step)} ({_bytes(r.comm_bytes_predicted)})",
                  _bytes(_largest(d.get("unsharded_peak_bytes_per_rank"))))
    return t


def pipeline_table(rows: list[Row]) -> Table | None:
    """Every pipeline row: its schedule and micro-batches, the cut, the idle fraction measured beside the
    schedule's theory, the step predicted by playing the schedule out, what goes point to point, and the
    activations each stage held at once."""
    chosen = [r for r in rows if r.status == "ok" and r.measured.bubble_theory is not None and "stages" in r.details]
    if not chosen:
        return None
    t = Table(title="Pipelines: idle time against theory, and what each stage holds", title_justify="left")
    for col in ("strategy", "schedule", "m", "stages (layers)", "idle", "theory", "ms (pred.)", "sent / step",
                "peak activations per stage", "model state per rank"):
        t.add_column(col, justify="left" if col in ("strategy", "schedule", "stages (layers)") else "right",
                     no_wrap=col == "strategy")
    for r in chosen:
        d, m = r.details, r.measured
        idle = "-" if m.bubble_measured is None else f"{m.bubble_measured:.0%}"
        pred = f"{r.step_ms_p50:.1f} ({r.step_ms_predicted:.1f})" if r.step_ms_predicted else f"{r.step_ms_p50:.1f}"
        t.add_row(r.label, d.get("schedule", "-"), str(d.get("microbatches", 1)), d["stages"], idle,
                  f"{m.bubble_theory:.0%}", pred, _bytes(r.comm_bytes_per_step),
                  " / ".join(_bytes(b) for b in d.get("stage_peak_activation_bytes") or d.get("stage_activation_bytes")
                             or []),
                  " / ".join(_bytes(b) for b in d.get("model_state_bytes_per_device") or []))
    return t


def pipeline_gaps(rows: list[Row]) -> list[str]:
    """Why a pipeline row idled more than its schedule's theory (by over a quarter of it): the theory
    assumes equal stages and free hand-offs."""
    out = []
    for r in rows:
        m, busy = r.measured, r.details.get("stage_busy_ms")
        if r.status != "ok" or m.bubble_measured is None or not busy or len(busy) < 2:
            continue
        theory = m.bubble_theory or 0.0
        if m.bubble_measured <= theory * 1.25 or m.bubble_measured - theory <= 0.02:
            continue
        why = (f"its stages were busy {' / '.join(f'{b:.1f}' for b in busy)} ms a step, and a faster stage waits for "
               "a slower one, which the theory's equal stages leave out" if max(busy) > 1.1 * min(busy) else
               f"its stages were equally busy ({' / '.join(f'{b:.1f}' for b in busy)} ms), so the rest is what each "
               "of the m hand-offs costs (copies, queues, send/recv), which the theory leaves out")
        out.append(f"{r.label}: idle {m.bubble_measured:.0%} of each step against {theory:.0%} in theory: {why}.")
    return out


def _reduce_scatter_caveat(rows: list[Row]) -> list[str]:
    """What a reduce-scatter costs against an all-reduce, as a sharded strategy's ranks timed them in this
    run: the reason ZeRO and FSDP are slow on CPU, in numbers."""
    timed = [r for r in rows if r.measured.reduce_scatter_all_grads_ms and r.measured.allreduce_all_grads_ms]
    if not timed:
        return []
    r, m = timed[0], timed[0].measured
    ratio = m.reduce_scatter_all_grads_ms / m.allreduce_all_grads_ms
    line = (f"reduce-scatter vs all-reduce, timed by {r.label}'s ranks: {m.reduce_scatter_all_grads_ms:.1f} ms "
            f"against {m.allreduce_all_grads_ms:.1f} ms for every gradient ({ratio:.2f}x; all-gather "
            f"{m.all_gather_all_params_ms:.1f} ms)")
    if r.device_kind in ("virtual", "shared"):  # gloo either way
        return [line + ", though a ring reduce-scatter sends half an all-reduce's bytes: gloo reduce-scatters by "
                "all-reducing and keeping a chunk (PR #118911), so on CPU the sharded strategies pay more time "
                "than DDP for their memory saving. On NCCL a reduce-scatter moves half the bytes and takes about "
                "half the time: there the saving is real."]
    return [line + "; a ring reduce-scatter sends half an all-reduce's bytes (about 0.5x expected)."]


def advice(rows: list[Row]) -> list[str]:
    """Which strategy when, on this hardware, from this run's numbers (no sentence is fixed in advance).
    Rows on one device (serial, pass-through) say what a strategy's machinery costs, not which layout to
    choose: they are left out, and a run with nothing else says so."""
    ok = [r for r in rows if r.status == "ok" and r.speedup is not None
          and (r.world_size > 1 or r.strategy == "single")]
    exact = [r for r in ok if r.equivalence.verdict in ("match", "baseline")]
    out = []
    if ok and all(r.world_size == 1 for r in ok):
        return ["One device: nothing here runs in parallel, so there is no layout to choose; the rows show what "
                "each strategy's machinery costs against `single` (cuda:0x2 shares one GPU between 2 ranks)."]
    if exact:
        best = max(exact, key=lambda r: r.speedup)
        noisy = best.equivalence.basis.startswith("this model's own")  # equivalence.own_noise's rule
        like = "like one device, within the model's own rounding noise" if noisy else "exactly like one device"
        out.append(f"Fastest that trains {like}: {best.label}, {best.speedup:.2f}x on "
                   f"{best.world_size} device(s) ({best.efficiency:.0%} efficiency).")
        for r in ok:
            if r.equivalence.verdict == "not-expected" and r.speedup > best.speedup:
                ratio = f", eval loss {r.eval_loss / exact[0].eval_loss:.2f}x single's" if r.eval_loss and \
                    exact[0].eval_loss else ""
                out.append(f"Faster still: {r.label}, {r.speedup:.2f}x, but not the same training{ratio}.")
    slower = [r for r in ok if r.world_size > 1 and r.speedup < 1]
    if slower:
        out.append("Slower than one device here: " + ", ".join(f"{r.label} {r.speedup:.2f}x" for r in slower) + ".")
    for r in ok:
        m = r.measured
        if m.exposed_comm_ms is not None and r.step_ms_p50:
            out.append(f"{r.label}: {m.exposed_comm_ms / r.step_ms_p50:.0%} of each step is communication not "
                       f"hidden behind compute ({m.exposed_over_allreduce:.2f}x one all-reduce of every gradient).")
    return out


def cost_lines(model: dict | None) -> list[str]:
    if not model:
        return []
    ab = (f"all-reduce alpha {model['alpha_us']:.0f} us, beta {model['beta_ns_per_byte']:.2f} ns/B, "
          if model["alpha_us"] is not None else "")
    proj = model["projection"]
    gpus = ", ".join(f"{n} GPUs {us:.3g} us" for n, us in proj["us_by_gpus"].items())
    return [f"pred. ms: the cost model calibrated in this run ({ab}copy {model['copy_GB_per_s']:.1f} GB/s, compute "
            "measured per batch size): compute on one device's share + communication not hidden + bubble.",
            f"Projection, not measured: all-reduce of these gradients at the published {proj['busbw_GB_per_s']:.0f} "
            f"GB/s NCCL bus bandwidth (8xH200): {gpus} (optimistic across nodes)."] + memory_lines(model)


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


def show(rows: list[Row], environment: dict, console: Console | None = None, skipped: dict | None = None,
         cost_model: dict | None = None) -> None:
    console = console or make_console()
    console.print(table(rows, environment))
    for extra in (sharding_table(rows), pipeline_table(rows)):
        if extra is not None:
            console.print(extra)
    for line in notes(rows, environment, skipped) + cost_lines(cost_model):
        console.print(f"- {line}", style="dim", highlight=False)
    lines = advice(rows)
    if lines:
        console.print("[bold]Which strategy, on this hardware (from this run):[/]")
        for line in lines:
            console.print(f"  {line}", highlight=False)


def make_console() -> Console:
    """A terminal's own width; 200 columns when written to a file or a pipe (rich would use 80)."""
    console = Console()
    return console if console.is_terminal else Console(width=200)


def make_progress(console: Console | None = None) -> Progress:
    """The progress bar of every long command: what runs now, done/total, time elapsed."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)
