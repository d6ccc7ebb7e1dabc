"""The experts family's measurement (expert_parallel: each rank holds some of every layer's experts, rows go
to them by all-to-all, kit.expert_dispatch): the bytes predicted from the run's own routing beside the
measured ones, the rows each expert computed, the share that left their rank, the time in the experts,
the drops past the capacity, the expert state per rank; the report's table and picture of them.

    MEASURE = experts.Experts(ep_of, held=lambda t: t.state.owned)      # expert_parallel

It is lent the ranks per expert-parallel group (config -> ep) and the experts a rank holds; it finds the
Dispatch itself, in the model's routed layers, and counts inside it in the loop's counted steps (`watch`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import torch.distributed as td
from torch import nn

from parallel import measure
from parallel.kit.collectives import every_rank
from parallel.kit.tensors import param_bytes
from parallel.loop import wire
from parallel.loop.results import Row
from parallel.measure.context_view import by_rank, ms, per_rank_figure, sent
from parallel.measure.formulas import element_bytes
from parallel.measure.sharded_cost import ring_allreduce_bytes
from parallel.style import charts, tables
from parallel.style.tables import largest, num, size
from parallel.world.devices import synchronizer


@dataclass
class Result:
    """What an expert-parallel run measured (details["experts"]); per rank: one entry a rank, in rank order;
    per step: over the loop's counted steps."""

    FAMILY: ClassVar[str] = "experts"
    ep: int = 1  # ranks per expert-parallel group
    capacity_factor: float = 0.0  # 0: dropless
    comm_bytes_predicted: float | None = None  # from this run's routing: the row's prediction (worker.py)
    bytes_predicted_by_collective: dict = field(default_factory=dict)
    all_to_all_uniform_formula: float = 0.0  # the all-to-all under even routing: 4 T k h e (ep-1)/ep
    experts_per_rank: list = field(default_factory=list)  # the global index of each expert a rank holds
    rows_leaving_share_per_rank: list = field(default_factory=list)  # of its routed rows, those sent away
    rows_per_expert_per_layer_per_rank: list = field(default_factory=list)  # [rank][layer][its expert], a step
    expert_ms_per_step_per_rank: list = field(default_factory=list)
    dropped_assignments_per_rank: list = field(default_factory=list)  # past the capacity, every step
    assignments_per_rank: list = field(default_factory=list)
    expert_state_bytes_per_rank: list = field(default_factory=list)
    single_expert_state_bytes: int = 0  # one device's: every expert


@dataclass
class Seen:
    """What a Dispatch did in the counted steps, every layer: kept on it (dispatch.seen) by `watch`."""

    rows_out: int = 0  # rows sent to other ranks (there)
    rows_in: int = 0  # rows received from other ranks
    rows_routed: int = 0  # every kept row of this rank's tokens (its own experts' included)
    load: list = field(default_factory=list)  # per call: rows each of this rank's experts computed
    expert_s: float = 0.0  # seconds in this rank's experts
    element: tuple = (4, 4)  # bytes per element of the rows going out and of the outputs coming back


class Experts(measure.Family):
    """Expert parallelism measured. `ep`: config -> ranks per expert-parallel group; `held`: t -> the global
    index of each expert this rank holds, in every layer."""


    def __init__(self, ep, held):
        self.ep, self.held = ep, held

    def watch(self, t) -> None:
        """Wrap the Dispatch's plan and run on the instance: in the loop's counted steps, the rows each moves
        and each expert computes, and the time in the experts (synchronized there only: those steps are
        not timed)."""
        dispatch = t.model.moe_layers()[0].dispatch  # one for every layer
        seen, plan, result = Seen(), dispatch.plan, dispatch.run
        rank = td.get_rank(dispatch.group) if dispatch.group is not None else 0
        dispatch.seen = seen

        def counted_plan(counts):
            send, recv, grid = plan(counts)
            if wire.counting():
                seen.rows_out += sum(send) - send[rank]
                seen.rows_in += sum(recv) - recv[rank]
                seen.rows_routed += sum(send)
                seen.load.append(grid.sum(0).tolist())
            return send, recv, grid

        def timed_run(experts, rows, per_expert):
            if not wire.counting():
                return result(experts, rows, per_expert)
            sync = synchronizer(rows.device)
            sync()
            start = time.perf_counter()
            out = result(experts, rows, per_expert)
            sync()
            seen.expert_s += time.perf_counter() - start
            seen.element = (rows.element_size(), out.element_size())
            return out

        dispatch.plan, dispatch.run = counted_plan, timed_run

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        """Bytes beside the prediction from this run's routing; rows per expert; drops; expert state per rank."""
        layers, ep, steps = t.model.moe_layers(), self.ep(run), max(1, result.wire.counted)
        d = layers[0].dispatch
        seen, held, n = d.seen, self.held(t), len(layers)
        tokens = run.batch_size // run.world_size * run.workload.input_shape[0]
        width = layers[0].router.in_features
        single_model = run.workload.build_model(run.seed)
        predicted = predicted_bytes(single_model, run, ep, (seen.rows_out + seen.rows_in) / steps, seen.element)
        loads = [[sum(c[j] for c in seen.load[i::n]) / steps for j in range(len(held))] for i in range(n)]
        out = Result(ep, layers[0].capacity_factor, sum(predicted.values()), predicted,
                     2 * tokens * layers[0].top_k * width * sum(seen.element) * (ep - 1) / ep * n,
                     experts_per_rank=every_rank(held),
                     rows_leaving_share_per_rank=every_rank(round(seen.rows_out / max(1, seen.rows_routed), 4)),
                     rows_per_expert_per_layer_per_rank=every_rank(loads),
                     expert_ms_per_step_per_rank=every_rank(round(seen.expert_s * 1e3 / steps, 3)),
                     dropped_assignments_per_rank=every_rank(d.dropped), assignments_per_rank=every_rank(d.assigned),
                     expert_state_bytes_per_rank=every_rank(expert_bytes(t.model)),
                     single_expert_state_bytes=expert_bytes(single_model))
        return {"bytes_per_step_by_collective": result.wire.per_step(), Result.FAMILY: out}


# What is predicted -------------------------------------------------------------------------------------


def expert_bytes(model: nn.Module) -> int:
    return param_bytes(p for moe in model.moe_layers() for p in moe.experts.parameters())


def predicted_bytes(model: nn.Module, run, ep: int, rows_moved: float, element: tuple) -> dict[str, float]:
    """Bytes a rank sends per step, by collective, given one device's `model`, the rows it moved per step
    (out and in, every layer) and the element sizes of a row going out and of an output coming back: each
    row crosses twice forward (there, and its output back) and twice backward (the output's gradient
    there, the row's gradient back), so 4 rows' worth per routed row that leaves; the counts (E int64 per
    layer, forward); the gradients' all-reduces."""
    n = run.world_size
    layers, width = model.moe_layers(), model.moe_layers()[0].router.in_features
    experts = layers[0].num_experts
    a2a = rows_moved * width * sum(element) + (ep - 1) / ep * experts * 8 * len(layers)
    total_experts = expert_bytes(model)  # one device's: every expert
    dense = param_bytes(model.parameters()) - total_experts
    reduce = ring_allreduce_bytes(dense, n) + ring_allreduce_bytes(total_experts / ep, n // ep)
    if run.workload.aux_loss:
        reduce += ring_allreduce_bytes(experts * element_bytes(run.precision), n) * len(layers)
    return {"all_to_all": a2a, "all_reduce": reduce}


# What is shown -----------------------------------------------------------------------------------------


def rows_of(rows: list[Row]) -> list[tuple[Row, Result]]:
    return [(r, res) for r in rows if (res := measure.result_of(r, Result)) is not None]


def imbalance(res: Result) -> float | None:
    """The busiest expert's rows over the mean expert's, in the worst layer of the worst expert-parallel
    group (its ranks wait for it at the combine's all-to-all)."""
    ep, loads = res.ep, res.rows_per_expert_per_layer_per_rank
    worst = None
    for g in range(0, len(loads), ep):
        for layer in range(len(loads[g])):
            rows = [n for rank in loads[g:g + ep] for n in rank[layer]]
            if rows and sum(rows):
                worst = max(worst or 0.0, max(rows) / (sum(rows) / len(rows)))
    return worst


def table(rows: list[Row]):
    """Every expert-parallel row: bytes beside the prediction from its routing, the share of routed rows
    that left their rank, the busiest expert against the mean and each rank's time in its experts, the
    share of assignments dropped past the capacity, and the expert parameters a rank holds against 1/ep of
    one device's. ep: "2x2" is ep 2 x dp 2."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    t = tables.table("Experts: bytes against the routing's prediction; balance, drops, expert parameters per rank",
                     [("strategy", "left"), ("ep", "left"), ("cap.", "right"), ("sent (pred.)", "right"),
                      ("away", "right"), ("max/mean", "right"), ("expert ms", "left"), ("dropped", "right"),
                      ("experts (1/ep)", "right")])
    t.columns[0].no_wrap = True
    for r, res in chosen:
        ep = res.ep
        away = [v for v in res.rows_leaving_share_per_rank if v is not None]
        dropped, assigned = sum(res.dropped_assignments_per_rank or [0]), sum(res.assignments_per_rank or [0])
        held, single = largest(res.expert_state_bytes_per_rank), res.single_expert_state_bytes
        t.add_row(r.strategy, f"{ep}x{r.world_size // ep}", num(res.capacity_factor or None, "g"), sent(r),
                  f"{sum(away) / len(away):.0%}" if away else "-", num(imbalance(res), ".2f"),
                  by_rank(res.expert_ms_per_step_per_rank[:ep], ms),
                  f"{dropped / assigned:.1%}" if assigned and dropped else "0",
                  f"{size(held, short=True)} ({size(single / ep, short=True)})" if single else size(held))
    return t


def picture(rows: list[Row]) -> str | None:
    """Each expert-parallel row's ranks: the rows its experts computed per step, every layer summed, one
    segment per expert (bars, left), and the time it spent in them (dots, right): the busiest rank sets
    the pace, since every rank waits for it at the combine's all-to-all."""
    chosen = rows_of(rows)
    if not chosen:
        return None
    bars = []
    for r, res in chosen:
        times = res.expert_ms_per_step_per_rank
        for k, layers in enumerate(res.rows_per_expert_per_layer_per_rank[:res.ep]):
            held = res.experts_per_rank[k]
            bars.append((f"{r.label} rank {k}", held, [sum(layer[j] for layer in layers) for j in range(len(held))],
                         times[k] if k < len(times) else None))
    fig, left = per_rank_figure([b[0] for b in bars], [b[3] for b in bars],
                                "rows its experts computed per step (every layer)", "ms in its experts per step")
    colours = charts.plt().get_cmap("tab10").colors
    for y, (_, held, counts, _) in enumerate(bars):
        start = 0.0
        for expert, n in zip(held, counts, strict=True):
            left.barh(y, n, left=start, color=colours[expert % 10], edgecolor="white")
            left.text(start + n / 2, y, f"e{expert}", ha="center", va="center", fontsize=7, color="white")
            start += n
    return charts.svg(fig)
