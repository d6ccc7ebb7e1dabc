"""The report of a comparison: the terminal screen, details.txt, report.html and its pictures, the notes
and the verdict, the cost model's prediction, the scaling sweep. `write` is its one door: the commands hand
it the rows and it writes every file and the screen."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from parallel import strategies
from parallel.loop import profiling
from parallel.loop.results import Row, atomic_write, write_results
from parallel.world import machine


def write(config, rows: list[Row], console, *, chosen=(), skipped: dict | None = None, env: dict | None = None,
          cost: bool = False, project_params: float = 0, wide: bool = False) -> int:
    """Everything a comparison shows, from its rows: with `cost`, the planner's memory for each row's layout
    and the cost model's step times first (chosen: the runs' (strategy, label, config)); then, in
    config.out, results.json/.csv, details.txt, report.html and the profiler's merged timeline; then the
    terminal. 0 when every row is ok, else 1."""
    from parallel.report import costmodel, memcheck, overview, page, report

    env = env or machine.environment(config.spec)
    env.setdefault("run", overview.run_facts(config))
    model = None
    if cost:
        memcheck.attach(rows, chosen, config)  # the planner's memory for each row's layout (counted, not run)
        # The cost model times `single` on the whole model: not where it does not fit (the shallow twin's runs)
        model = {} if strategies.BASELINE in (skipped or {}) else costmodel.apply(rows, chosen, config, env)
        if project_params:
            model["memory_projection"] = costmodel.memory_projection(project_params)
    tracks = cost and config.profile and profiling.merge(Path(config.out) / "tb", Path(config.out) / "timeline.json")
    if config.out:
        out = Path(config.out)
        write_results(out, dataclasses.asdict(config), env, rows, skipped, model)
        atomic_write(out / "details.txt", report.details_text(rows, env, skipped, model))
        page.write(out / "report.html", rows, env, skipped)
    report.show(rows, env, console, skipped, model, wide=wide)
    if config.out:
        logs = ", logs/ (a line a step)" if (Path(config.out) / "logs").is_dir() else ""
        console.print(f"files in {config.out}/:\n  report.html (pictures), details.txt (every row), results.json/.csv"
                      f"{logs}", highlight=False, markup=False)
    if tracks:
        console.print(f"timeline: {config.out}/timeline.json, {tracks} tracks (every rank of every strategy, each "
                      "strategy from t = 0): open it in https://ui.perfetto.dev or chrome://tracing", highlight=False)
    return 0 if rows and all(r.ok for r in rows) else 1
