"""The sharded family's report: model state per rank by kind beside the ZeRO formula, bytes by collective
(two tables), the reduce-scatter note, and their pictures for report.html."""

from __future__ import annotations

from parallel.measure.sharded import result
from parallel.style import charts
from parallel.style.tables import largest, size, table

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "send")


def rows(all_rows: list) -> list:
    """The rows with a ZeRO stage (zero, zero_optimizer, fsdp, and ddp, the unsharded reference), when a
    sharded one is among them."""
    chosen = [r for r in all_rows if (found := result(r)) is not None and found.zero_stage is not None]
    return chosen if any(result(r).zero_stage for r in chosen) else []


def sent_by_collective(r) -> dict[str, float]:
    """A row's bytes per step by collective (the loop's count, kept in its details by the families that
    show it), or its whole count as an all-reduce's."""
    return r.details.get("bytes_per_step_by_collective") or (
        {"all_reduce": r.comm_bytes_per_step} if r.comm_bytes_per_step else {})


def tables(all_rows: list) -> list:
    """Model state per rank by kind beside the ZeRO paper's formula, and bytes per step by collective."""
    chosen = rows(all_rows)
    if not chosen:
        return []
    masters = any(result(r).master_bytes_per_rank for r in chosen)  # bf16-master: fp32 copies apart
    state = table("Sharded data parallel: model state per rank (the largest rank)",
                  [("strategy", "left"), ("params", "right"), ("grads", "right"),
                   *([("master", "right")] if masters else []), ("moments" if masters else "optimizer", "right"),
                   ("model state", "right"), ("ZeRO formula", "right"), ("gathered peak", "right")])
    kinds = [k for k in COLLECTIVES if any(sent_by_collective(r).get(k) for r in chosen)]
    sent = table("... and bytes each rank sends per step, by collective",
                 [("strategy", "left"), *((k.replace("_", "-"), "right") for k in kinds), ("total", "right"),
                  ("textbook", "right")])
    for r in chosen:
        s = result(r)
        held = (s.param_bytes_per_rank, s.grad_bytes_per_rank, *([s.master_bytes_per_rank] if masters else []),
                s.optimizer_state_bytes_per_rank)
        state.add_row(r.label, *(size(largest(v)) for v in held),
                      size(largest(r.details.get("model_state_bytes_per_device"))), size(s.zero_formula_bytes),
                      size(largest(s.unsharded_peak_bytes_per_rank)))
        by = sent_by_collective(r)
        sent.add_row(r.label, *(size(by.get(k)) if by.get(k) else "-" for k in kinds),
                     size(r.comm_bytes_per_step), size(r.comm_bytes_predicted))
    return [state, sent]


def notes(all_rows: list) -> list[str]:
    """What a reduce-scatter costs against an all-reduce, as a sharded strategy's ranks timed them in this
    run: the reason ZeRO and FSDP are slow on CPU, in numbers."""
    timed = [r for r in all_rows if r.measured.reduce_scatter_all_grads_ms and r.measured.allreduce_all_grads_ms]
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


def _per_rank(value, ranks: int) -> list:
    return (value or []) + [None] * (ranks - len(value or []))


def memory(all_rows: list) -> str | None:
    """Model state each rank holds, stacked params / grads / optimizer state, with the ZeRO formula's
    figure for the strategy as a diamond."""
    bars = []  # (label, {kind: bytes}, formula bytes or None)
    for r in rows(all_rows):
        s = result(r)
        for k in range(r.world_size):
            parts = {kind: _per_rank(v, r.world_size)[k] for kind, v in (
                ("params", s.param_bytes_per_rank), ("grads", s.grad_bytes_per_rank),
                *((("master", s.master_bytes_per_rank),) if s.master_bytes_per_rank else ()),
                ("optimizer", s.optimizer_state_bytes_per_rank))}
            if any(v is not None for v in parts.values()):
                bars.append((f"{r.label} rank {k}", parts, s.zero_formula_bytes))
    return charts.stacked(bars)


def collectives(all_rows: list) -> str | None:
    """Bytes one rank sends per step, stacked by collective, for every row that sends any."""
    shown = [(r, sent_by_collective(r)) for r in all_rows if r.status == "ok"]
    shown = [(r, by) for r, by in shown if by and any(by.values())]
    if not shown:
        return None
    plt = charts.plt()
    kinds = list(dict.fromkeys(k for _, by in shown for k in by))
    colors = dict(zip(kinds, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    fig, ax = plt.subplots(figsize=(7.5, charts.height(len(shown))))
    seen = set()
    for i, (r, by) in enumerate(shown):
        left = 0.0
        for k in kinds:
            if by.get(k):
                ax.barh(i, charts.mib(by[k]) * 1024, left=left, color=colors[k], label=None if k in seen else k)
                seen.add(k)
                left += charts.mib(by[k]) * 1024
        if r.comm_bytes_predicted:
            ax.plot(charts.mib(r.comm_bytes_predicted) * 1024, i, marker="|", color="black", ms=12,
                    label=None if "textbook" in seen else "textbook")
            seen.add("textbook")
    ax.set_yticks(range(len(shown)), [r.label for r, _ in shown])
    ax.invert_yaxis()
    ax.set_xlabel("KiB sent per rank per step")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    return charts.svg(fig)
