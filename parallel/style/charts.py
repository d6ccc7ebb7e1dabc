"""The style of every picture in report.html (report/pictures.py, and the measurement families' own):
matplotlib drawn to inline SVG, no script, no network; and the stacked bars that two of them share."""

from __future__ import annotations

import io

KIND_COLOR = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}


def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False})
    return plt


def svg(fig) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt().close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def height(n: int) -> float:
    return 0.9 + 0.32 * max(n, 1)


def mib(n) -> float:
    return (n or 0) / 2**20


def stacked(bars: list[tuple]) -> str | None:
    """Horizontal bars of (label, {kind: bytes}, formula bytes or None), each stacked by kind, the formula
    as a diamond."""
    if not bars:
        return None
    fig, ax = plt().subplots(figsize=(7.5, height(len(bars))))
    seen = set()
    for i, (_, parts, formula) in enumerate(bars):
        left = 0.0
        for kind, value in parts.items():
            if not value:
                continue
            color = KIND_COLOR.get(kind, "#8c8c8c")
            ax.barh(i, mib(value), left=left, color=color, label=None if kind in seen else kind)
            seen.add(kind)
            left += mib(value)
        if formula:
            ax.plot(mib(formula), i, marker="D", color="black", ms=5,
                    label=None if "ZeRO formula" in seen else "ZeRO formula")
            seen.add("ZeRO formula")
    ax.set_yticks(range(len(bars)), [b[0] for b in bars])
    ax.invert_yaxis()
    ax.set_xlabel("MiB per rank (the largest rank's where only one is measured)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return svg(fig)
