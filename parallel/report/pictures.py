"""The pictures of OUT/report.html (report/page.py), each an inline SVG from matplotlib: speedup with its
spread, model state per rank stacked by kind beside the ZeRO formula, bytes by collective, each
pipeline's measured schedule beside the schedule replayed, and each strategy's error over its tolerance
per tensor."""

from __future__ import annotations

from parallel.loop.results import Row
from parallel.report import overview
from parallel.style.charts import height as _height
from parallel.style.charts import plt as _plt
from parallel.style.charts import svg as _svg

KIND_COLOR = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}
VERDICT_COLOR = {"match": "#55a868", "baseline": "#4c72b0", "not-expected": "#dd8452", "mismatch": "#c44e52",
                 "unchecked": "#999999"}
PIECE_COLOR = {"F": "#4c72b0", "B": "#dd8452", "I": "#dd8452", "W": "#8172b3", "L": "#55a868"}


# The figures --------------------------------------------------------------------------------------------


def speedup(rows: list[Row]) -> str | None:
    """Speedup over `single` per row: a bar (hollow where the row is noisy or flagged), the [min-max] of
    paired rounds where there are rounds, and a tick at the ideal (the device count)."""
    shown = [r for r in rows if r.status == "ok" and r.speedup is not None]
    if not shown:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, _height(len(shown))))
    over = next((r.speedup_over for r in shown if r.speedup_over), "")  # `single` did not fit: over this row
    for i, r in enumerate(shown):
        color = VERDICT_COLOR.get(r.equivalence.verdict, "#999999")
        doubted = overview.status(r) != "ok"
        ax.barh(i, r.speedup, color="none" if doubted else color, edgecolor=color, hatch="//" if doubted else None,
                linewidth=1.2)
        if len(r.round_speedups) > 1:
            lo, hi = min(r.round_speedups), max(r.round_speedups)
            ax.errorbar(r.speedup, i, xerr=[[r.speedup - lo], [hi - r.speedup]], color="black", capsize=3, lw=1)
        if not over:  # the ideal is the device count only over one device
            ax.plot([r.world_size, r.world_size], [i - 0.4, i + 0.4], color="#333333", lw=1.5, ls=":")
        ax.text(r.speedup, i, f" {r.speedup:.2f}x" + (" (noisy)" if doubted else ""), va="center", fontsize=8)
    ax.axvline(1.0, color="#777777", lw=0.8)
    ax.set_yticks(range(len(shown)), [r.label for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel(f"samples/s over {over}'s, the fastest that matched (single does not fit); hollow: noisy/flagged"
                  if over else "speedup over `single` (samples/s ratio, this run); dotted: ideal = devices; hollow: "
                  "noisy/flagged")
    return _svg(fig)


def errors(rows: list[Row]) -> str | None:
    """Every tensor's difference from `single`'s over its tolerance, per strategy (log scale; 1 is the
    tolerance): how close each came, and which tensors a mismatch is in."""
    shown = [r for r in rows if r.equivalence.per_tensor]
    if not shown:
        return None
    plt = _plt()
    floor = 1e-6
    fig, ax = plt.subplots(figsize=(7.5, _height(len(shown))))
    for i, r in enumerate(shown):
        values = [max(v, floor) for v in r.equivalence.per_tensor.values() if v == v and v != float("inf")]
        color = VERDICT_COLOR.get(r.equivalence.verdict, "#999999")
        ax.scatter(values, [i] * len(values), s=12, color=color, alpha=0.7)
        if r.equivalence.worst_tensor:
            ax.text(max(values + [floor]), i + 0.3, f" {r.equivalence.worst_tensor}", fontsize=7, va="center")
    ax.axvline(1.0, color="#c44e52", lw=1)
    ax.set_xscale("log")
    ax.set_xlim(floor / 2, max(10.0, max(max(r.equivalence.per_tensor.values()) for r in shown) * 2))
    ax.set_yticks(range(len(shown)), [r.label for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel(f"difference from `single` over its tolerance, one dot a tensor (1: the tolerance; {floor:g}: exact)")
    return _svg(fig)
