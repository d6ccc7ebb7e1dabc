"""What `plan` prints: the ranking (or one layout's memory and time), and `--validate`'s tables."""

from __future__ import annotations

import json
from pathlib import Path

from parallel.errors import ConfigError
from parallel.plan import search
from parallel.plan import validate as v
from parallel.tables import num
from parallel.tables import table as _table


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
    if not best["fits"]:
        console.print(f"[red]Nothing fits[/]: the layout needing least memory needs {best['memory_gib']['total']:.1f}"
                      f" GiB of the {cl.gpu.memory_gib:.0f} GiB a {cl.gpu.name} has.")
    elif len(results) > 1:
        console.print(search.explain(best, results[1:], tried))
    console.print(f"TFLOP/s and MFU: {best['flops']}; peak {cl.peak(train.precision) / 1e12:.0f} TFLOP/s. "
                  "docs/planner.md says what the model leaves out.")


def _count(n: float) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _errors(title: str, rows: list[dict], unit: str, source: str = "published"):
    t = _table(title, [("row", "left"), (f"{source} {unit}", "right"), ("predicted", "right"), ("error", "right")])
    for r in rows:
        t.add_row(r["row"], f"{r['published']:.2f}", f"{r['predicted']:.2f}", f"{r['error']:+.1%}")
    s = v.summary(rows)
    t.caption = f"mean |error| {s['mean']:.1%}, worst {s['worst']:.1%}"
    return t


def validate(args, console) -> int:
    tables = {"narayanan_table1": v.table1(), "korthikanti_table5": v.table5(), "korthikanti_figure1": v.figure1(),
              "narayanan_table2": v.table2(), "single_h100": v.single_h100()}
    machine = this_machine(args.results)
    if args.json:
        print(json.dumps({k: {"rows": rows, **v.summary(rows)} for k, rows in tables.items()}
                         | {"crossover": v.crossover(tables["narayanan_table2"]), "this_machine": machine}, indent=1))
        return 0
    console.print(_errors("Narayanan et al. 2021, Table 1: TFLOP/s per GPU (eq. 3, with recompute)",
                          tables["narayanan_table1"], "TF/s"))
    console.print(_errors("Korthikanti et al. 2022, Table 5: seconds per iteration", tables["korthikanti_table5"], "s"))
    console.print(_errors("Korthikanti et al. 2022, Figure 1: GiB per GPU", tables["korthikanti_figure1"], "GiB"))
    console.print(_errors("Narayanan et al. 2021, Table 2: TFLOP/s per GPU at a fixed batch",
                          tables["narayanan_table2"], "TF/s"))
    cross = v.crossover(tables["narayanan_table2"])
    ratios = "; ".join(f"{k} {' '.join(f'{x:.2f}' for x in r['predicted'])} (published "
                       f"{' '.join(f'{x:.2f}' for x in r['published'])})" for k, r in cross["ratios"].items())
    console.print(f"Table 2's crossover {'reproduced' if cross['reproduced'] else '[red]NOT reproduced[/]'}: "
                  f"throughput per GPU over the fewest GPUs' as they double: {ratios}.")
    console.print(_errors("One H100, GPT-2 small, eager (the fit): ms a step", tables["single_h100"], "ms",
                          "measured"))
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
