"""Memory per device: the planner's figure for each row's layout beside what the run measured.

    planner      plan/local.need: parameters, gradients, SGD's momentum (model state by the layout's tp,
                 pp, ep split and ZeRO stage), the blocks' activations (activations.formula) and the logits
    measured     model state: the bytes the strategy's own tensors hold on its busiest device (exact, every
                 device kind); on GPUs also the peak allocated and reserved of every rank, the largest shown

On the CPU a process's peak resident set holds the interpreter, torch and every virtual device at once, so
only model state is compared there; on GPUs the peak allocated is the whole of it. What the planner leaves
out shows as the gap: autocast's bf16 copies of the weights, communication buckets, the allocator's blocks.
"""

from __future__ import annotations

from rich.table import Table

from parallel.loop.results import Row
from parallel.models.usermodel import shape_model
from parallel.style.tables import largest
from parallel.style.tables import table as table_of

KINDS = ("parameters", "gradients", "optimizer", "activations")


def attach(rows: list[Row], chosen: list[tuple], config) -> None:
    """Each row's planner figure (bytes by kind, its layout) into its details["planner_memory"]; the model
    counted on the meta device, once."""
    from parallel.plan import local  # the planner, only after the runs

    model = shape_model(config)
    for (strategy, _, cfg), row in zip(chosen, rows, strict=False):
        if row.status == "ok" and (need := local.need(strategy.name, cfg, model)) is not None:
            row.details["planner_memory"] = need


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.0f}M" if n >= 2**20 else f"{n / 2**10:,.0f}K"


def _off(measured: float | None, planned: float | None) -> str:
    return "-" if not measured or not planned else f"{measured / planned - 1:+.0%}"


def table(rows: list[Row]) -> Table | None:
    """One line per row the planner has a figure for: model state planned and measured, activations
    planned, the total planned against the peak allocated (GPUs), and the peak reserved."""
    shown = [r for r in rows if r.details.get("planner_memory")]
    if not shown:
        return None
    gpu = any(r.peak_mem_kind == "cuda_max_allocated" for r in shown)
    cols = ("strategy", "layout", "state", "measured", "off", "activ.", "total") + \
        (("peak alloc", "off", "reserved") if gpu else ())
    t = table_of("Memory per device: the planner's figure for each layout against the run (busiest device)",
                 [(c, "left" if c in ("strategy", "layout") else "right") for c in cols])
    for r in shown:
        p = r.details["planner_memory"]
        state = largest(r.details.get("model_state_bytes_per_device"))
        total = None if p["activations"] is None else p["total"]  # a model whose activations are not counted
        cells = [r.strategy + (f" {r.variant}" if r.variant else ""), p["layout"], _mib(p["model_state"]),
                 _mib(state), _off(state, p["model_state"]), _mib(p["activations"]), _mib(total)]
        if gpu:
            peak = r.peak_mem_bytes if r.peak_mem_kind == "cuda_max_allocated" else None
            together = r.device_kind == "shared" and r.launcher == "inprocess" and r.world_size > 1
            cells += [_mib(peak), "-" if together or total is None else _off(peak, total),  # replicas on one GPU
                      _mib(r.details.get("cuda_max_reserved"))]
        t.add_row(*cells)
    return t
