"""The report's first screen, on the terminal and in report.html alike: the run in one line (`header`) and
the main table, every strategy against `single` (`table`; its cells, `main_cells`, for the page)."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from parallel.judge import twin
from parallel.loop.results import Row
from parallel.style.tables import count as _count
from parallel.style.tables import num as _num
from parallel.style.tables import size as _bytes
from parallel.style.tables import table as _table

VERDICT_STYLE = {"match": "green", "baseline": "cyan", "mismatch": "bold red", "not-expected": "yellow",
                 "unchecked": "dim"}


# The run ------------------------------------------------------------------------------------------------


def run_facts(config) -> dict:
    """What was trained, for the header and results.json: the workload (the user's model by its label),
    its parameter count, the batch, steps and warm-up, precision and seed."""
    from parallel.models.usermodel import shape_model

    label = config.workload + (f" ({config.preset or config.arch or 'gpt'})" if config.shaped else "")
    return {"workload": label, "params": sum(p.numel() for p in shape_model(config).parameters()),
            "global_batch": config.batch_size, "steps": config.steps, "warmup": config.warmup,
            "precision": config.precision, "seed": config.seed, "why": config.why, **_step(config)} | _uneven(config)


def _step(config) -> dict:
    """The optimiser step the run trained with (loop/optim.py), as the header and the notes say it."""
    return {"optimizer": config.optimizer, "lr": config.lr, "weight_decay": config.weight_decay,
            "clip_norm": config.clip_norm, "lr_schedule": config.lr_schedule, "warmup_steps": config.warmup_steps}


def _uneven(config) -> dict:
    """With --tokens padded or packed, or a --data file whose targets do not all count: the real tokens of
    one rank's equal share of the batch (1/N of its rows, N the devices), the least and the most of every
    share of every step the run trains, and their mean."""
    from parallel.loop.tokens import weighable
    from parallel.models.data import FILE
    from parallel.models.usermodel import workload_of

    workload = workload_of(config)
    if workload.tokens == "even":
        return {}
    n, b = max(1, config.world_size), config.batch_size
    data = workload.dataset(config.seed, b)
    per_rank = {"read_per_rank": config.data} if getattr(data, "per_rank", False) and weighable(workload) else {}
    shares = [int(s.sum()) for step in range(config.warmup + config.steps)
              for s in data.real_targets(step).split(b // n)]
    if workload.tokens == FILE and min(shares) == max(shares):  # a file whose targets all count: even after all
        return per_rank
    return per_rank | {"tokens": workload.tokens, "real_tokens_per_share": [min(shares), max(shares)],
            "real_tokens_mean": sum(shares) / len(shares), "shares": n,
            "own_mean_loss": not weighable(workload)}  # a loss the harness cannot weigh (loop/tokens.py)


def header(environment: dict) -> str:
    """The run in one line: workload and size, batch, steps, devices, precision, seed, torch."""
    run, kind = environment.get("run") or {}, environment["device_kind"]
    what = f"{run['workload']} {_count(run['params'])} params" if run else "?"
    steps = f"{run['steps']} steps + {run['warmup']} warm-up" if run else ""
    return " · ".join(x for x in (
        what, f"batch {run.get('global_batch', '?')}", steps,
        f"{environment['devices']} {kind}" + ("" if kind == "virtual" else f", {environment['backend']}"),
        run.get("precision", ""), _recipe(run), f"seed {run.get('seed', '?')}", f"torch {environment['torch']}") if x)


def _recipe(run: dict) -> str:
    """"adamw lr 0.003 clip 1 cosine": the step in a few words ("" for a run recorded before #72)."""
    if not run.get("optimizer"):
        return ""
    clip = f" clip {run['clip_norm']:g}" if run.get("clip_norm") else ""
    schedule = f" {run['lr_schedule']}" if run.get("lr_schedule", "constant") != "constant" else ""
    warm = f" warm-up {run['warmup_steps']}" if run.get("warmup_steps") else ""
    return f"{run['optimizer']} lr {run['lr']:g}{clip}{schedule}{warm}"


# The main table -----------------------------------------------------------------------------------------


def status(r: Row) -> str:
    """ok | noisy | flag (a measurement that cannot be right as it stands) | the failure."""
    if r.status != "ok":
        return {"timed-out": "timeout"}.get(r.status, r.status)
    if any(f.startswith("noisy") for f in r.flags):
        return "noisy"
    return "flag" if any(not f.startswith("real effect") for f in r.flags) else "ok"


def _devices(r: Row, run_kind: str) -> str:
    return str(r.world_size) if r.device_kind == run_kind else f"{r.world_size} {r.device_kind}"


def speedup_text(r: Row, spread: bool = True) -> str:
    """The speedup; with --repeat the median of the paired rounds, and (spread) their range."""
    text = _num(r.speedup, ".2f")
    if spread and len(r.round_speedups) > 1:
        text += f" [{min(r.round_speedups):.2f}-{max(r.round_speedups):.2f}]"
    return text


def equivalence_text(r: Row) -> str:
    """The verdict, and the largest difference over its tolerance: "match 0.0025"."""
    eq = r.equivalence
    if eq.ratio is None or eq.verdict == "baseline":
        return eq.verdict
    return f"{eq.verdict} {'<0.001' if 0 < eq.ratio < 0.001 else format(eq.ratio, '.2g')}"  # 12 columns at most


def main_cells(r: Row, run_kind: str, spread: bool = False) -> list[str]:
    """A row of the main table (MAIN's columns), as the terminal and report.html show it."""
    return [r.label, _devices(r, run_kind), _num(r.step_ms_p50, ".1f"), speedup_text(r, spread),
            _num(r.efficiency, ".0%"), _bytes(r.peak_mem_bytes), _bytes(r.comm_bytes_per_step), equivalence_text(r),
            status(r)]


MAIN = [("strategy", "left"), ("devices", "left"), ("ms p50", "right"), ("speedup", "right"), ("eff.", "right"),
        ("peak mem", "right"), ("sent/step", "right"), ("equivalence", "left"), ("status", "left")]
WIDE = [("strategy", "left"), ("launch", "left"), ("devices", "left"), ("ms p50 (p95)", "right"),
        ("pred. ms", "right"), ("samples/s", "right"), ("speedup", "right"), ("eff.", "right"), ("peak mem", "right"),
        ("sent/step (pred.)", "right"), ("loss", "right"), ("eval loss", "right"), ("equivalence", "left"),
        ("status", "left")]


def table(rows: list[Row], environment: dict, wide: bool = False, skipped: dict | None = None) -> Table:
    kind = environment["device_kind"]
    t = _table(twin.title(rows, skipped) or "Every strategy against `single`", WIDE if wide else MAIN)
    t.columns[0].min_width = 16  # a strategy's name whole (context_parallel); a long variant label folds
    for r in rows:
        state = Text(status(r), style="" if status(r) == "ok" else "bold red" if r.status != "ok" else "yellow")
        verdict = Text(equivalence_text(r), style=VERDICT_STYLE.get(r.equivalence.verdict, ""))
        if wide:
            p50 = "-" if r.step_ms_p50 is None else f"{r.step_ms_p50:.1f} ({r.step_ms_p95:.1f})"
            t.add_row(r.label, r.launcher, f"{r.world_size} {r.device_kind}", p50, _num(r.step_ms_predicted, ".1f"),
                      _num(r.samples_per_s, ",.0f"), speedup_text(r), _num(r.efficiency, ".0%"),
                      _bytes(r.peak_mem_bytes),
                      f"{_bytes(r.comm_bytes_per_step)} ({_bytes(r.comm_bytes_predicted)})",
                      _num(r.final_loss, ".4f"), _num(r.eval_loss, ".4f"), verdict, state)
        else:
            t.add_row(*main_cells(r, kind)[:-2], verdict, state)
    return t

