"""What `plan` prints: the ranking (or one layout's memory and time), and `--validate`'s tables."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from parallel.plan import search
from parallel.plan.evidence import validate as v
from parallel.style.tables import num
from parallel.style.tables import table as _table
from parallel.world.errors import ConfigError


def show(console, model, cl, train, results: list[dict], tried: int, top: int) -> None:
    best = results[0]
    console.print(f"[bold]{model.name or 'model'}[/]: {_count(model.params)} parameters "
                  f"({_count(model.active_params)} active), {model.layers} layers, h {model.hidden}, seq "
                  f"{model.seq}; {cl.gpus} x {cl.gpu.name}, {cl.per_node} a node; global batch "
                  f"{train.global_batch}, {train.precision}, {train.attention} attention")
    t = _table("Layouts, fastest first" if len(results) > 1 else "The layout",
               [("layout", "left"), ("step s", "right"), ("tok/s/GPU", "right"), ("TFLOP/s", "right"),
                ("MFU", "right"), ("GiB", "right"), ("bubble", "right"), ("exposed comm", "left")])
    t.columns[0].no_wrap = True
    for r in results[:top]:
        comm = " ".join(f"{k}{s / r['step_s']:.0%}" for k, s in r["exposed_comm_s"].items() if s / r["step_s"] >= .005)
        t.add_row(r["describe"], f"{r['step_s']:.2f}", f"{r['tokens_per_s_per_gpu']:,.0f}",
                  f"{r['tflops_per_gpu']:.0f}", f"{r['mfu']:.0%}",
                  f"{r['memory_gib']['total']:.1f}" + ("" if r["fits"] else " (no fit)"),
                  f"{r['parts_s']['bubble'] / r['step_s']:.0%}", comm or "-")
    console.print(t)
    mem = _table("Memory per GPU, GiB", [("kind", "left"), ("busiest stage", "right")])
    for k, gib in best["memory_gib"].items():
        mem.add_row(k, f"{gib:.2f}")
    console.print(mem)
    if not best["fits"] and "refused" in best:
        console.print(f"[red]Nothing runs[/]: the layout needing least memory is refused: {best['refused']}.")
    elif not best["fits"]:
        console.print(f"[red]Nothing fits[/]: the layout needing least memory needs {best['memory_gib']['total']:.1f}"
                      f" GiB of the {cl.gpu.memory_gib:.0f} GiB a {cl.gpu.name} has.")
    elif len(results) > 1:
        console.print(search.explain(best, results[1:], tried))
    console.print(f"TFLOP/s and MFU: {best['flops']}; peak {cl.peak(train.precision) / 1e12:.0f} TFLOP/s. "
                  "docs/planner.md says what the model leaves out.")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _errors(title: str, rows: list[dict], unit: str, source: str = "published", role: str = ""):
    t = _table(f"{role.capitalize()}: {title}" if role else title,
               [("row", "left"), (f"{source} {unit}", "right"), ("predicted", "right"), ("error", "right")])
    for r in rows:
        t.add_row(r["row"], f"{r['published']:.2f}", f"{r['predicted']:.2f}", f"{r['error']:+.1%}")
    s = v.summary(rows)
    t.caption = f"mean |error| {s['mean']:.1%}, worst {s['worst']:.1%}"
    return t


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _playbook(console, scored: dict, loo: dict | None, role: str, source: str) -> None:
    """The sweep's scores: the choice first (per cell), then fits against ran / crashed, then the errors."""
    s = scored["summary"]
    t = _table(f"{role.capitalize()}: {source}: the planner's pick per (model, GPUs)",
               [("model", "left"), ("GPUs", "right"), ("ran", "right"), ("best measured", "left"),
                ("planner's pick", "left"), ("loss", "right"), ("Spearman", "right")])
    for c in scored["cells"]:
        pick = c["pick"].split(" ", 1)[-1] if c["pick"] else "nothing fits" if c["says_nothing_fits"] else "-"
        best = c["best"].split(" ", 1)[-1] if c["best"] else "none ran"
        t.add_row(c["model"], str(c["gpus"]), f"{c['ran']}/{c['layouts']}", best, pick, _pct(c["pick_loss"]),
                  "-" if c["spearman"] is None else f"{c['spearman']:.2f}")
    t.caption = (f"pick among the layouts that ran: loss {_pct(s['pick_loss_mean'])} mean, {_pct(s['pick_loss_worst'])}"
                 f" worst; among all it calls fitting (a crash scores 0): {_pct(s['pick_loss_any_mean'])} mean")
    console.print(t)
    cf = scored["confusion"]
    t = _table("Fits: the planner's word against the run", [("planner says", "left"), ("ran", "right"),
                                                             ("crashed or OOM", "right")])
    for says in ("fits", "no fit"):
        t.add_row(says, str(cf[f"{says}, ran"]), str(cf[f"{says}, crashed"]))
    t.caption = (f"{_pct(s['crashed_called_fits'])} of the crashed called fitting, {_pct(s['ran_called_oom'])} of "
                 "those that ran called out of memory")
    console.print(t)
    console.print(f"Tokens/s/GPU: median |error| {_pct(s['median_error'])} ({_pct(s['median_error_mfu20'])} where "
                  f"MFU >= 20%); memory: median |error| {_pct(s['median_mem_error'])}. {s['ran']} ran, {s['crashed']}"
                  f" crashed, {scored['dropped']} inconsistent rows dropped; --json has every row.", highlight=False)
    if loo:
        t = _table("Leave one model out: fitted on the other models' rows, scored on this one's",
                   [("left out", "left"), ("pick loss", "right"), ("crashed fits", "right"), ("ran OOM", "right"),
                    ("tok/s err", "right"), ("MFU>=20", "right"), ("memory err", "right")])
        keys = ("pick_loss_mean", "crashed_called_fits", "ran_called_oom", "median_error", "median_error_mfu20",
                "median_mem_error")
        for model, x in [(m, r["score"]) for m, r in loo.items()] + [("all (the fit)", s)]:
            t.add_row(model, *(_pct(x[k]) for k in keys))
        t.caption = "medians of |error| per row; pick loss: the mean over the model's cells"
        console.print(t)


def validate(args, console) -> int:
    sweep = args.sweep
    if sweep:
        if not Path(sweep).is_file():
            raise ConfigError(f"--sweep {sweep}: no such file")
        try:
            scored = v.playbook(sweep)
        except (OSError, ValueError, csv.Error) as e:
            raise ConfigError(f"--sweep {sweep}: not a sweep of the Playbook's columns "
                              f"({(str(e) or e.__class__.__name__).splitlines()[0]})") from None
        if args.json:
            print(json.dumps({"sweep": {"role": "held out (given)", "file": sweep, **scored}}, indent=1))
            return 0
        _playbook(console, scored, None, "held out", sweep)
        return 0
    machine = this_machine(args.results)  # bad --results refused first, before seconds of fitting
    tables = {"narayanan_table1": v.table1(), "narayanan_table2": v.table2(),
              "korthikanti_table5": v.table5(), "single_h100": v.single_h100(), "korthikanti_figure1": v.figure1()}
    tables["h100_compare_single"] = v.compare_single_h100(tables["single_h100"])
    from parallel.plan.evidence import fit
    from parallel.plan.evidence import playbook as pb

    scored, loo = v.playbook(), fit.leave_one_model_out(pb.runs()[0])
    loo_t5, loo_h100 = fit.fit_a100()["leave_one_out"], fit.fit_h100_host()["leave_one_out"]
    roles = {k: {"role": r, "fitted": what} for k, (r, what) in v.ROLES.items()}
    if args.json:
        print(json.dumps({"playbook_1node": {**roles["playbook_1node"], **scored, "leave_one_model_out": loo}}
                         | {k: {**roles[k], "rows": rows, **v.summary(rows)} for k, rows in tables.items()}
                         | {"leave_one_out": {"korthikanti_table5": loo_t5, "single_h100": loo_h100}}
                         | {"crossover": v.crossover(tables["narayanan_table2"]), "this_machine": machine}, indent=1))
        return 0
    _playbook(console, scored, loo, "fit", "The Ultra-Scale Playbook, 8 x H100 (nanotron)")
    console.print(_errors("Narayanan et al. 2021, Table 1: TFLOP/s per GPU (eq. 3, with recompute)",
                          tables["narayanan_table1"], "TF/s", role="held out"))
    console.print(_errors("Narayanan et al. 2021, Table 2: TFLOP/s per GPU at a fixed batch",
                          tables["narayanan_table2"], "TF/s", role="held out"))
    cross = v.crossover(tables["narayanan_table2"])
    ratios = "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in r['predicted'])} (published "
                       f"{' '.join(f'{x:.2f}' for x in r['published'])})" for k, r in cross["ratios"].items())
    console.print(f"Table 2's crossover {'reproduced' if cross['reproduced'] else '[red]NOT reproduced[/]'}: "
                  f"throughput per GPU over the fewest GPUs' as they double: {ratios}.")
    console.print(_errors("One H100, compare's single step: ms a step", tables["h100_compare_single"], "ms",
                          "measured", role="held out"))
    t = _errors("Korthikanti et al. 2022, Table 5: seconds per iteration", tables["korthikanti_table5"], "s",
                role="fit")
    t.caption += (f" (residuals); leave one row out: {_pct(loo_t5['mean'])} mean, {_pct(loo_t5['worst'])} worst")
    console.print(t)
    h100 = tables["single_h100"]
    t = _errors("One H100, GPT-2 small, a bare eager loop: ms a step", h100, "ms", "measured", role="fit")
    cal = h100[0]["calibration"]
    residuals = ", ".join(f"{r['residual']:+.1%}" for r in h100)
    t.caption += (f"; that run's calibration (compute x{cal['compute']:.3f}, overhead x{cal['overhead']:.3f}) "
                  f"leaves residuals {residuals}; leave one step out of it: "
                  f"{', '.join(_pct(x) for x in loo_h100['calibration'])}")
    console.print(t)
    console.print(_errors("Korthikanti et al. 2022, Figure 1: GiB per GPU", tables["korthikanti_figure1"], "GiB",
                          role="identity"))
    console.print("Roles: held out, nothing fitted on it; fit, constants fitted on it (python -m "
                  "parallel.plan.evidence.fit fits them again); identity, the source's own formula recomputed.",
                  highlight=False)
    if machine:
        t = _table(f"This machine's comparison ({machine['folder']}): the same ring and ZeRO formulas, calibrated "
                   "in the run", [("strategy", "left"), ("step ms", "right"), ("pred.", "right"), ("ratio", "right"),
                                  ("sent/step", "right"), ("pred.", "right")])
        for r in machine["rows"]:
            t.add_row(r["strategy"], num(r["step_ms"]), num(r["step_ms_predicted"]), num(r["step_ratio"], ".2f"),
                      num(r["sent"], ",.0f"), num(r["sent_predicted"], ",.0f"))
        t.caption = f"predicted over measured step: median {num(machine['median_ratio'], '.2f')}"
        console.print(t)
    else:
        console.print("No comparison of this machine to check (run ./launch.sh compare, or give --results DIR).")
    return 0


def this_machine(folder: str | None) -> dict | None:
    """The newest comparison's rows: measured step and bytes beside the cost model's prediction."""
    if folder is None:
        runs = sorted(Path("results").glob("run-*/results.json"), key=lambda p: p.stat().st_mtime)
        if not runs:
            return None
        path = runs[-1]
    else:
        path = Path(folder) / "results.json"
    try:
        doc = json.loads(path.read_text())
        out = []
        for r in doc["rows"]:
            if r.get("status") != "ok":
                continue
            ms, pred = r.get("step_ms_p50"), r.get("step_ms_predicted")
            out.append({"strategy": (r["strategy"] + " " + r.get("variant", "")).strip(), "step_ms": ms,
                        "step_ms_predicted": pred, "step_ratio": pred / ms if ms and pred else None,
                        "sent": r.get("comm_bytes_per_step"), "sent_predicted": r.get("comm_bytes_predicted")})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConfigError(f"--results {path.parent}: no readable results.json ({e.__class__.__name__})") from None
    ratios = [r["step_ratio"] for r in out if r["step_ratio"]]
    return {"folder": str(path.parent), "rows": out,
            "median_ratio": sorted(ratios)[len(ratios) // 2] if ratios else None}
