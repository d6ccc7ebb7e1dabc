"""The context family's report (measure/context.py measures): a table of every context-parallel row's bytes
beside the formula, each rank's causal pairs, attention time and activations; a picture of each rank's
causal work and time; a picture of the attention's bytes, the ring's against the all-to-all's."""

from __future__ import annotations

from rich.table import Table

from parallel import measure
from parallel.loop.results import Row
from parallel.measure.context import Result
from parallel.style import charts, tables
from parallel.style.tables import count, largest, size


def rows_of(rows: list[Row]) -> list[tuple[Row, Result]]:
    return [(r, res) for r in rows if (res := measure.result_of(r, Result)) is not None]


def by_rank(values, show) -> str:
    """Each rank's value, shown, one after another."""
    return " ".join(show(v) for v in values or [] if v is not None) or "-"


def ms(v: float) -> str:
    return f"{v:.0f}" if v >= 10 else f"{v:.2g}"


def sent(r: Row) -> str:
    """Bytes a rank sent per step, and the prediction in brackets."""
    return f"{size(r.comm_bytes_per_step, short=True)} ({size(r.comm_bytes_predicted, short=True)})"


def table(rows: list[Row]) -> Table | None:
    """Every context-parallel row: bytes per step beside the formula, each rank's causal (q, k) pairs and
    attention time (its layout's balance), and the activations a rank saves against 1/cp of one device's."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    t = tables.table("Context parallel: bytes against the formula; each rank's causal pairs, attention time, "
                     "activations", [("strategy", "left"), ("layout", "left"), ("cp", "right"),
                                     ("sent (formula)", "right"), ("causal pairs", "left"), ("attention ms", "left"),
                                     ("activations (1/cp of one)", "right")])
    t.columns[0].no_wrap = True  # a strategy's name whole
    for r, res in chosen:
        single = largest(res.single_activation_bytes_per_rank)
        mine = size(largest(res.activation_bytes_per_rank), short=True)
        t.add_row(r.strategy, f"{res.layout or '-'} {res.comm}", str(res.cp), sent(r),
                  by_rank(res.causal_pairs_per_rank[:res.cp], count), by_rank(res.attention_ms_per_rank[:res.cp], ms),
                  f"{mine} ({size(single / res.cp, short=True)})" if single else mine)
    return t


def per_rank_figure(labels: list[str], times: list, left_label: str, right_label: str):
    """Two panels sharing one row per rank: the caller draws bars on the left (returned), and the time on
    the right as dots."""
    fig, (left, right) = charts.plt().subplots(1, 2, figsize=(9, charts.height(len(labels))), sharey=True)
    left.set_xlabel(left_label)
    right.plot([v or 0 for v in times], range(len(labels)), "o", color="#dd8452")
    right.set_xlabel(right_label)
    left.set_yticks(range(len(labels)), labels)
    left.invert_yaxis()
    return fig, left


def picture(rows: list[Row]) -> str | None:
    """Each context-parallel row's ranks: the causal (q, k) pairs its layout gives them (bars, left) and
    the attention time measured on them (dots, right)."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    bars = [(f"{r.label} rank {k}", pairs, t) for r, res in chosen for k, (pairs, t) in enumerate(zip(
        res.causal_pairs_per_rank[:res.cp], res.attention_ms_per_rank + [None] * res.cp, strict=False))]
    fig, left = per_rank_figure([b[0] for b in bars], [b[2] for b in bars], "causal (q, k) pairs per head and sequence",
                                "attention ms (forward + backward, no communication)")
    left.barh(range(len(bars)), [b[1] for b in bars], color="#4c72b0")
    return charts.svg(fig)


def crossing(rows: list[Row]) -> str | None:
    """Each mode's attention bytes per rank and step against the ranks splitting the sequence, by formula
    (lines: the ring's, the all-to-all's) for the first context row's shape, and every row that reduces its
    gradients by all-reduce as a dot at its own ranks: what it sent besides that all-reduce."""
    chosen = rows_of(rows)
    if not chosen or not chosen[0][1].bytes_by_ranks.get("ranks"):
        return None
    by = chosen[0][1].bytes_by_ranks
    fig, ax = charts.plt().subplots(figsize=(7.5, 3.2))
    for mode, color in (("ring", "#4c72b0"), ("a2a", "#dd8452")):
        points = [(p, charts.mib(v)) for p, v in zip(by["ranks"], by[mode], strict=True) if v is not None]
        if points:  # the heads may allow the all-to-all at none of them
            ax.plot(*zip(*points, strict=True), "-", color=color, label=f"{mode} (formula)")
    for r, res in chosen:
        sent = (r.details or {}).get("bytes_per_step_by_collective") or {}
        if "all_reduce" in sent and r.strategy in ("context_parallel", "ulysses"):
            ax.plot(res.cp, charts.mib(sum(sent.values()) - sent["all_reduce"]), "o", color="black")
            ax.annotate(r.label, (res.cp, charts.mib(sum(sent.values()) - sent["all_reduce"])), fontsize=7,
                        xytext=(4, 2), textcoords="offset points")
    ax.set_xscale("log", base=2)
    ax.set_xticks(by["ranks"], [str(p) for p in by["ranks"]])
    ax.set_xlabel("ranks splitting each sequence")
    ax.set_ylabel("MiB per rank per step")
    ax.legend(fontsize=8, frameon=False)
    return charts.svg(fig)
