"""Scaling sweep: the same strategies at several device counts, strong and weak.

    strong: the global batch stays --batch-size; each device gets less as devices are added
    weak:   each device keeps --batch-size; the global batch grows with the devices

One comparison per (mode, device count) in OUT/scaling/<mode>-<n>/, then OUT/scaling.json and .csv and
three plots: throughput.png and efficiency.png against devices, loss_curves.png per strategy. On
`cpu:N` the N virtual devices share the same cores, so adding devices splits the machine rather than
growing it: the plots say so in their titles.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import statistics
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from parallel.config import nearest_multiple
from parallel.loop.results import Row, atomic_write
from parallel.strategies import BASELINE

MODES = ("strong", "weak")


def points(config, world_sizes: list[int]) -> list[tuple[str, int, object]]:
    """(mode, devices, config) of every comparison in the sweep."""
    out = []
    for mode in MODES:
        for n in world_sizes:
            devices = str(config.spec.first(n))  # the user's GPUs (cuda:4,5,6,7: cuda:4 first), not cuda:0..n-1
            batch = config.batch_size * (n if mode == "weak" else 1)
            if config.batch_auto and mode == "strong":  # one batch that every count divides (1,2,3,4: 516)
                batch = nearest_multiple(type(config).batch_size, math.lcm(*world_sizes))
            sub = str(Path(config.out) / "scaling" / f"{mode}-{n}")
            out.append((mode, n, dataclasses.replace(config, devices=devices, world_size=0, batch_size=batch,
                                                      batch_auto=False,
                                                      out=sub).validate()))
    return out


BASELINE_SPREAD = 0.15  # `single` in strong scaling trains the same batch at every point: it must agree


def flag_baselines(results: list[tuple[str, int, list[Row]]]) -> None:
    """In strong scaling `single` runs the same global batch on one device at every point of the sweep, so
    its samples/s must agree; a point whose baseline is more than BASELINE_SPREAD off the sweep's median
    (a burst of foreign load, say) would scale every speedup of its column, and is flagged."""
    base = {n: rows[0] for mode, n, rows in results if mode == "strong" and rows and rows[0].strategy == BASELINE
            and rows[0].samples_per_s}
    if len(base) < 2:
        return
    typical = statistics.median(r.samples_per_s for r in base.values())
    for n, r in base.items():
        if abs(r.samples_per_s / typical - 1) > BASELINE_SPREAD:
            r.flags.append(f"the baseline at {n} device(s) ran at {r.samples_per_s / typical:.0%} of its median over "
                           f"the sweep: every speedup of that column is off by as much; re-run with --repeat 3, "
                           "or on a quiet machine")


def summarize(results: list[tuple[str, int, list[Row]]]) -> list[dict]:
    """A row per (mode, devices, strategy); with --repeat, the paired rounds' range of speedup and
    efficiency (lo, hi), which the plots draw as error bars."""
    def spread(r: Row, scale: float) -> tuple:
        return (min(r.round_speedups) / scale, max(r.round_speedups) / scale) if len(r.round_speedups) > 1 else \
            (None, None)

    return [{"mode": mode, "devices": n, "strategy": r.label, "world_size": r.world_size,
             "global_batch": r.global_batch, "samples_per_s": r.samples_per_s, "speedup": r.speedup,
             "speedup_lo": spread(r, 1)[0], "speedup_hi": spread(r, 1)[1],
             "efficiency": r.efficiency, "efficiency_lo": spread(r, r.world_size)[0],
             "efficiency_hi": spread(r, r.world_size)[1], "foreign_cpu": r.foreign_cpu,
             "flags": " | ".join(r.flags), "status": r.status, "equivalence": r.equivalence.verdict}
            for mode, n, rows in results for r in rows]


def write(out: Path, table: list[dict], results, virtual: bool) -> list[Path]:
    atomic_write(out / "scaling.json", json.dumps(table, indent=2))
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(table[0]))
    writer.writeheader()
    writer.writerows(table)
    atomic_write(out / "scaling.csv", buf.getvalue())
    return plot(out, table, results, virtual)


def plot(out: Path, table: list[dict], results, virtual: bool) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    note = " (virtual CPU devices sharing the same cores)" if virtual else ""
    strategies = list(dict.fromkeys(r["strategy"] for r in table))
    files = []
    for metric, label, name in (("samples_per_s", "samples/s", "throughput"),
                                ("efficiency", "efficiency (speedup / devices)", "efficiency")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
        for ax, mode in zip(axes, MODES, strict=True):
            for s in strategies:
                pts = [r for r in table if r["mode"] == mode and r["strategy"] == s and r[metric] is not None]
                if not pts:
                    continue
                x, y = [r["devices"] for r in pts], [r[metric] for r in pts]
                lo, hi = metric.split("_")[0] + "_lo", metric.split("_")[0] + "_hi"  # efficiency's paired range
                if all(r.get(lo) is not None for r in pts):  # --repeat: the rounds' range as error bars
                    err = [[v - r[lo] for v, r in zip(y, pts, strict=True)], [r[hi] - v for v, r in zip(y, pts,
                                                                                                       strict=True)]]
                    line = ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=s).lines[0]
                else:
                    (line,) = ax.plot(x, y, marker="o", label=s)
                doubted = [(xi, yi) for xi, yi, r in zip(x, y, pts, strict=True) if r["flags"]]
                if doubted:  # a flagged point (noisy, or more than its devices can give): hollow, crossed
                    ax.plot(*zip(*doubted, strict=True), linestyle="none", marker="o", ms=11, mfc="white",
                            mec=line.get_color(), mew=1.5, zorder=3)
                    ax.plot(*zip(*doubted, strict=True), linestyle="none", marker="x", ms=6, color=line.get_color(),
                            zorder=4)
            devices = sorted({r["devices"] for r in table})
            if metric == "efficiency":
                ax.axhline(1.0, color="black", lw=1, ls=":", label="ideal")
            else:  # ideal: single's samples/s at one device, times the devices
                base = [r["samples_per_s"] for r in table if r["mode"] == mode and r["strategy"] == BASELINE
                        and r["samples_per_s"]]
                if base:
                    ax.plot(devices, [statistics.median(base) * n for n in devices], color="black", lw=1, ls=":",
                            label="ideal (single x devices)")
            ax.set_title(f"{mode} scaling" + ("; hollow, crossed: flagged points" if any(
                r["flags"] for r in table if r["mode"] == mode) else ""))
            ax.set_xticks(devices)
            ax.set_xlabel("devices")
            ax.set_ylabel(label)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{label.split(' ')[0].capitalize()} against devices{note}")
        fig.tight_layout()
        files.append(out / f"{name}.png")
        fig.savefig(files[-1], dpi=110)
        plt.close(fig)
    mode, n, rows = max((p for p in results if p[0] == "strong"), key=lambda p: p[1])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-."]
    for i, r in enumerate(r for r in rows if r.losses):  # synchronous strategies overlap: that is the point
        ax.plot(range(len(r.losses)), r.losses, styles[i % len(styles)], label=r.label, linewidth=2.5 - 0.3 * i)
    ax.set_title(f"Training loss per step, strong scaling on {n} device(s)\n{note.strip(' ()')}", fontsize=10)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # no curves when every row at that point failed
        ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "loss_curves.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files


def report(config, results: list[tuple[str, int, list[Row]]], console) -> int:
    """The sweep's end: each point's `single` flagged, the rows measured under load in one line, the table of
    samples/s (efficiency) against devices, scaling.json/.csv and the plots. 0 when every row is ok."""
    from parallel.report.notes import flag_lines

    flag_baselines(results)
    every = [dataclasses.replace(r, variant=f"{r.variant} {mode} {n}".strip())
             for mode, n, rows in results for r in rows]
    for line in flag_lines(every):  # folded: one line for every row measured under load
        console.print(f"- {line}", style="yellow", highlight=False, markup=False)
    table = summarize(results)
    files = write(Path(config.out), table, results, virtual=not config.spec.real)
    t = Table(title="samples/s (efficiency) against devices", title_justify="left")
    t.add_column("strategy")
    for mode, n, _ in results:
        t.add_column(f"{mode} {n}", justify="right")
    for name in dict.fromkeys(r["strategy"] for r in table):
        cells = {(r["mode"], r["devices"]): r for r in table if r["strategy"] == name}
        t.add_row(escape(name), *[f"{c['samples_per_s']:,.0f} ({c['efficiency']:.0%})" if (c := cells.get((m, n))) and
                          c["samples_per_s"] and c["efficiency"] is not None else "-" for m, n, _ in results])
    console.print(t)
    console.print(f"scaling: {config.out}/scaling.json, scaling.csv; plots: " + ", ".join(f.name for f in files),
                  markup=False)
    return 0 if all(r.ok for _, _, rows in results for r in rows) else 1
