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
from pathlib import Path

from parallel.results import Row, atomic_write

MODES = ("strong", "weak")


def points(config, world_sizes: list[int]) -> list[tuple[str, int, object]]:
    """(mode, devices, config) of every comparison in the sweep."""
    kind = config.spec.kind
    out = []
    for mode in MODES:
        for n in world_sizes:
            devices = f"cpu:{n}" if kind == "cpu" else "cuda:" + ",".join(map(str, range(n)))
            batch = config.batch_size * (n if mode == "weak" else 1)
            sub = str(Path(config.out) / "scaling" / f"{mode}-{n}")
            out.append((mode, n, dataclasses.replace(config, devices=devices, world_size=0, batch_size=batch,
                                                      out=sub).validate()))
    return out


def summarize(results: list[tuple[str, int, list[Row]]]) -> list[dict]:
    return [{"mode": mode, "devices": n, "strategy": r.label, "world_size": r.world_size,
             "global_batch": r.global_batch, "samples_per_s": r.samples_per_s, "speedup": r.speedup,
             "efficiency": r.efficiency, "status": r.status, "equivalence": r.equivalence.verdict}
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
                pts = [(r["devices"], r[metric]) for r in table if r["mode"] == mode and r["strategy"] == s
                       and r[metric] is not None]
                if pts:
                    ax.plot(*zip(*pts, strict=True), marker="o", label=s)
            ax.set_title(f"{mode} scaling")
            ax.set_xticks(sorted({r["devices"] for r in table}))
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
    ax.legend(fontsize=8)
    fig.tight_layout()
    files.append(out / "loss_curves.png")
    fig.savefig(files[-1], dpi=110)
    plt.close(fig)
    return files
