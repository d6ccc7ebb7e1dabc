"""The layers family's measurement (manual_tp, tensor_parallel, fsdp_tp: the layers split over the ranks):
the collectives per transformer block beside Megatron's count, the activations one forward saves, Megatron's
textbook bytes and the cost model's step; and the report's table of one transformer layer's activations
measured beside the formula (parallel/measure/activations.py: the worker's LayerMeter, for every strategy that
declares LAYER_ACTIVATIONS: single and the context-parallel ones too).

    MEASURE = layers.Megatron()                          # manual_tp
    MEASURE = layers.Megatron(activations=True)          # tensor_parallel: one forward's saves as well
    MEASURE = layers.Megatron(dims=mesh_dims)            # fsdp_tp: dp x tp, FSDP over dp
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from rich.table import Table
from torch import nn

from parallel import measure
from parallel.kit import kv_copies
from parallel.kit.saved import ActivationMeter
from parallel.loop.results import Row
from parallel.measure.formulas import element_bytes
from parallel.measure.sharded_cost import ring_allreduce_bytes
from parallel.models.outputs import call
from parallel.models.workloads import summed_params, tp_plan_of
from parallel.style.tables import size, table


@dataclass
class Result:
    """What a tensor-parallel run measured beyond its time and bytes (details["layers"]): per counted step,
    the loop's collectives and bytes by kind (wire.Counter), per transformer block too."""

    FAMILY: ClassVar[str] = "layers"
    collectives_per_step: dict[str, float] = field(default_factory=dict)
    bytes_per_step_by_collective: dict[str, float] = field(default_factory=dict)
    backward_bytes_per_step: dict[str, float] = field(default_factory=dict)
    # Megatron: 4 all-reduces of B x T x C per block and step; with SP 4 all-gather + reduce-scatter pairs
    collectives_per_block_per_step: dict[str, float] = field(default_factory=dict)
    bytes_per_block_per_step: dict[str, float] = field(default_factory=dict)
    activation_bytes_per_rank: int | None = None  # saved for backward in one forward, this rank
    mesh: str = ""  # 2-D: the dp x tp layout
    kv_heads: str = ""  # grouped-query attention: its kv heads split over the ranks, or copied to them


class Megatron(measure.Family):
    """Megatron's tensor parallelism measured. `activations`: count what one forward saves for backward;
    `dims`: run -> the 2-D ParallelDims (dp x tp, FSDP over dp), None where every rank is one
    tensor-parallel group."""


    def __init__(self, activations: bool = False, dims=None):
        self.activations, self.dims = activations, dims

    def extra_measurements(self, t, data, run, dist, result) -> dict:
        out = Result(**result.wire.measurements())
        if self.activations:
            out.activation_bytes_per_rank = forward_activation_bytes(t, data.batch(0))  # the whole batch
        if self.dims is not None:
            out.mesh = str(self.dims(run))
        out.kv_heads = kv_copies.describe(run.meta_model, self._tp_dp(run)[0])
        return {Result.FAMILY: out}

    def _tp_dp(self, run) -> tuple[int, int]:
        lay = self.dims(run) if self.dims is not None else None
        return (lay.tp, lay.dp) if lay is not None else (run.world_size, 1)

    def comm_bytes_predicted(self, model, run) -> float | None:
        """Megatron's all-reduces (payloads), 2(N-1)/N of each per rank (sequence parallel: an all-gather
        and a reduce-scatter of the same activation, (N-1)/N each: the same bytes); none for 2-D."""
        if self.dims is not None or tp_plan_of(model) is None:
            return None
        copies = kv_copies.grad_bytes(model, run.world_size, element_bytes(run.precision))  # their gradients
        summed = [p.numel() * element_bytes(run.precision) for p in summed_params(model)]  # TPPlan.summed's hooks
        return sum(ring_allreduce_bytes(p, run.world_size) for p in [*payloads(model, run), *summed]) + copies

    def predict_step_ms(self, cal, run, row) -> float | None:
        """`single`'s step on a dp share split tp ways (each rank computes 1/tp of every split layer; the
        replicated ones are small here), plus Megatron's all-reduces of that share's activations over tp,
        none hidden (each blocks the next layer); 2-D, also FSDP's two all-gathers and one reduce-scatter
        of each rank's 1/tp of the parameters over dp, none hidden (gloo's reduce-scatter costs an
        all-reduce; an all-gather half of one)."""
        tp, dp = self._tp_dp(run)
        if cal.allreduce_ms(1, tp) is None:
            return None
        share = run.batch_size // dp  # the samples one tp group trains
        megatron = sum(cal.allreduce_ms(p, tp) for p in payloads(run.meta_model, run, share))
        ms = cal.compute_ms(share) / tp + megatron
        if dp > 1:
            allreduce = cal.allreduce_ms(cal.grad_bytes / tp, dp)  # of this rank's 1/tp of the parameters
            ms += (allreduce / 2 if cal.overlaps else allreduce) + 2 * allreduce / 2  # reduce-scatter, 2 gathers
        return ms


def forward_activation_bytes(t, batch) -> int:
    """Bytes autograd saves for backward in one forward of the model on `batch` (of a DTensor, what this
    rank holds), parameters left out: off the clock, after the run, on every rank alike (the forward's
    collectives); the graph is dropped unused. The sizes do not depend on the values."""
    x, y = (b.to(t.device) for b in batch)
    with torch.enable_grad(), ActivationMeter(t.model) as meter:
        out = call(t.model, x, y)
    del out
    return meter.bytes


def payloads(model, run, batch_size: int | None = None) -> list[float]:
    """Bytes of every activation Megatron all-reduces per step on `batch_size` samples (the run's batch by
    default): every rowwise layer's output forward (B x T x its outputs), and every region's (or colwise
    layer outside one) input gradient backward (B x T x its inputs); but not the gradient of the data
    itself, which nothing needs (the MLP's first layer)."""
    plan, w = tp_plan_of(model), run.workload
    samples = run.batch_size if batch_size is None else batch_size
    positions = samples * (w.input_shape[0] if w.data == "tokens" else 1)  # tokens: T per sample
    forward = [model.get_submodule(r).out_features for r in plan.rowwise]
    first_layer = next(n for n, _ in model.named_parameters()).rpartition(".")[0]
    entries = [*plan.regions, *(c for c in plan.colwise if not any(c.startswith(r + ".") for r in plan.regions))]
    backward = [_in_features(model, e) for e in entries if e != first_layer]
    return [positions * c * element_bytes(run.precision) for c in forward + backward]


def _in_features(model: nn.Module, name: str) -> int:
    """A region's (or a colwise layer's) input width: that of its first Linear."""
    return next(m for m in model.get_submodule(name).modules() if isinstance(m, nn.Linear)).in_features


# The report: one transformer layer's activations (the LayerMeter's details, layer_activation_*) ------------


def layer_rows(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.status == "ok" and r.details.get("layer_activation_predicted")]


def _layout(d: dict) -> str:
    lay = d.get("layer_activation_layout") or {}
    if lay.get("t", 1) > 1:
        return f"tp {lay['t']}{' sp' if lay.get('sp') else ''}"
    return f"cp {lay['cp']}" if lay.get("cp", 1) > 1 else "one"


def layer_table(rows: list[Row]) -> Table | None:
    """One transformer layer's activations on one rank, measured (each storage once) beside the formula
    (parallel/measure/activations.py) and its named terms: what tensor, sequence and context parallelism split."""
    chosen = layer_rows(rows)
    if not chosen:
        return None
    t = table("Activations of one transformer layer on one rank: measured against the formula's terms",
              [("strategy", "left"), ("layout", "left"), ("measured", "right"), ("formula", "right"),
               ("off", "right"), ("whole", "right"), ("split", "right"), ("core", "right"), ("kernel", "left")])
    t.columns[0].min_width = 16
    for r in chosen:
        d = r.details
        terms, measured, predicted = d["layer_activation_terms"], d["layer_activation_bytes"], d[
            "layer_activation_predicted"]
        t.add_row(r.label, _layout(d), size(measured, short=True), size(predicted, short=True),
                  f"{measured / predicted - 1:+.1%}", size(terms.get("whole"), short=True),
                  size(terms.get("split"), short=True), size(terms.get("core"), short=True),
                  (d.get("layer_activation_layout") or {}).get("kernel", "-"))
    return t


def layer_gaps(rows: list[Row]) -> list[str]:
    """Where one layer's measured activations are over the formula by more than 1%, which tensor."""
    out = []
    for r in layer_rows(rows):
        d = r.details
        extra = d["layer_activation_bytes"] - d["layer_activation_predicted"]
        if extra <= 0.01 * d["layer_activation_predicted"]:
            continue
        if n := d.get("layer_activation_gathered"):
            lay = d["layer_activation_layout"]
            out.append(f"{r.label}: {size(extra)} over the formula: DTensor's sequence parallelism keeps the "
                       f"all-gathered input of its {n} column-parallel regions (q, k, v; mlp.0), "
                       f"{lay['b']} x {lay['s']} x {lay['h']} each, for backward, where Megatron keeps its 1/"
                       f"{lay['t']} and gathers it again.")
        else:
            out.append(f"{r.label}: {size(extra)} over the formula, in no tensor it names.")
    return out
