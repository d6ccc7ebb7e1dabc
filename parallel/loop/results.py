"""The result schema (one Row per strategy) and atomic writing of results.json / results.csv."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from parallel.world.errors import ConfigError


@dataclass
class Equivalence:
    """The oracle's verdict on one row (judge/equivalence.py)."""

    verdict: str  # "baseline" | "match" | "mismatch" | "not-expected" | "unchecked"; an injected hang's
    #               "named" | "unnamed" (judge/named.py: did its diagnosis name it)
    max_abs_diff: float | None = None  # the worst tensor's largest difference from `single`'s ...
    tolerance: float | None = None  # ... and that tensor's own tolerance
    reason: str = ""
    worst_tensor: str = ""  # the tensor with the largest difference over its tolerance
    ratio: float | None = None  # the largest difference over its tolerance, tensors and steps: <= 1 matches
    first_step: int | None = None  # the first step whose loss was off by more than its tolerance
    basis: str = ""  # what the tolerance rests on: "fp32 rule", "bf16 autocast in both", or a strategy's own
    per_tensor: dict = field(default_factory=dict)  # every tensor's difference over its tolerance (report.html)


@dataclass(frozen=True)
class Rule:
    """What a verdict's tolerances rest on (judge/equivalence.py has the rules and their measurements):
    each tensor within rtol x max(its movement, floor x its magnitude), each step's loss within rtol x how
    far the loss had moved + loss_floor x the loss; `basis` is what the row says of it."""

    rtol: float
    floor: float
    loss_floor: float
    basis: str
    loss_rtol: float | None = None  # the losses' own, where it is not rtol (bf16 under AdamW: equivalence.py)


@dataclass
class Measured:
    """The measurements the report's advice and the cost model read, declared: a strategy sets them by
    name (a typo is a TypeError, not a silently missing line). Everything else a strategy measures goes
    to the row's free-form `details`."""

    exposed_comm_ms: float | None = None  # step time minus the same step without communication
    exposed_over_allreduce: float | None = None  # that, over one standalone all-reduce of every gradient
    allreduce_4B_ms: float | None = None  # the all-reduce latency (the cost model's alpha)
    allreduce_all_grads_ms: float | None = None  # one all-reduce of every gradient (with alpha: beta)
    reduce_scatter_all_grads_ms: float | None = None  # one reduce-scatter of every gradient (sharded DP)
    all_gather_all_params_ms: float | None = None  # one all-gather of every parameter (sharded DP)
    bubble_measured: float | None = None  # fraction of a step the pipeline's stages were idle
    bubble_theory: float | None = None  # the schedule's closed form, e.g. (p-1)/(m+p-1) (replay.CLOSED_FORMS)
    bubble_replayed: float | None = None  # every rank's actions replayed on the run's own piece times


@dataclass
class Row:
    strategy: str
    variant: str  # "" or the swept options, e.g. "bucket_mb=4"
    launcher: str
    devices: str
    device_kind: str  # "real" | "virtual" | "pass-through"
    world_size: int
    global_batch: int
    status: str = "ok"  # "ok" | "failed" | "timed-out"
    error: str | None = None
    step_ms_p50: float | None = None
    step_ms_p95: float | None = None
    step_ms_predicted: float | None = None  # the cost model's (report/costmodel.py)
    update_ms_p50: float | None = None  # the optimiser's update alone, rank 0's median (loop/clipping.py)
    samples_per_s: float | None = None
    speedup: float | None = None  # samples/s over `single` on ONE device of the same list, same run ...
    speedup_over: str = ""  # ... or over this row's, where single does not fit one device (judge/twin.py)
    efficiency: float | None = None  # speedup / world_size
    round_speedups: list = field(default_factory=list)  # --repeat: each round's samples/s over that round's single
    round_step_ms: list = field(default_factory=list)  # --repeat: each round's median step
    foreign_cpu: float | None = None  # share of the machine's CPU other processes used while it ran (the
    #   most of any round: world/load.py); above load.NOISY the row is "noisy"
    foreign_gpu_pids: list = field(default_factory=list)  # other processes computing on its GPUs
    flags: list = field(default_factory=list)  # results that cannot be right as measured, and what to do
    peak_mem_bytes: int | None = None
    peak_mem_kind: str | None = None  # "cuda_max_allocated" | "process_peak_rss"
    comm_bytes_per_step: float | None = None  # bytes one rank sends per optimiser step (measured)
    comm_bytes_predicted: float | None = None  # the textbook figure for the same
    final_loss: float | None = None  # training loss of the last step
    eval_loss: float | None = None  # loss of the final parameters on held-out samples (same for all)
    threads_per_device: int | None = None
    equivalence: Equivalence = field(default_factory=lambda: Equivalence("unchecked"))
    twin_blocks: int = 0  # > 0: the verdict is from a run on the shallow twin of this many blocks (single's row:
    #   it ran as the twin), not from this row's own run (judge/twin.py)
    losses: list[float] = field(default_factory=list)
    loss_parts: dict[str, list[float]] = field(default_factory=dict)  # each loss of a several-loss step (DCGAN)
    step_ms: list[float] = field(default_factory=list)
    grad_norms: dict[str, list[float]] = field(default_factory=dict)  # --clip-norm: the global gradient norm
    #   before the clip, every step, by optimiser ("": the one; the DCGAN's by part; loop/clipping.py)
    measured: Measured = field(default_factory=Measured)  # what the advice and the cost model read
    details: dict = field(default_factory=dict)  # strategy-specific measurements (JSON only)

    @property
    def label(self) -> str:
        return f"{self.strategy} {self.variant}" if self.variant else self.strategy

    @property
    def stem(self) -> str:
        """The name its files (config, result, log) take in a run's folders: file_stem(strategy, variant)."""
        return file_stem(self.strategy, self.variant)

    @classmethod
    def from_dict(cls, data: dict) -> Row:
        data = dict(data)
        data["equivalence"] = Equivalence(**data.get("equivalence", {"verdict": "unchecked"}))
        data["measured"] = Measured(**data.get("measured", {}))
        return cls(**data)

    @property
    def ok(self) -> bool:
        return self.status == "ok" and self.equivalence.verdict != "mismatch" and \
            not self.details.get("replicas_diverged")  # --check-replicas: copies that must be equal parted


def tb_run(strategy: str, variant: str = "") -> str:
    """A row's run in TensorBoard, the folder of OUT/tb/ that holds its scalars and its ranks' profiler
    traces: "ddp", or "ddp_accum-2" for a variant (TensorBoard's run names: no spaces or "=")."""
    return f"{strategy}_{variant}".replace(" ", "_").replace("=", "-") if variant else strategy


def file_stem(strategy: str, variant: str) -> str:
    """A row's files' name: "ddp", or "ddp-bucket_mb=4" for a variant (compare.run_one, the report's notes)."""
    return f"{strategy}-{variant}" if variant else strategy


# Lists stay in results.json; the CSV has one scalar per column.
CSV_SKIP = {"losses", "loss_parts", "grad_norms", "step_ms", "equivalence", "measured", "details"}


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file beside `path`, then rename: a reader never sees half a file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as an ordinary file's mode, not mkstemp's owner-only 0600
        with os.fdopen(fd, "w", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_results(out: Path, config: dict, environment: dict, rows: list[Row], skipped: dict | None = None,
                  cost_model: dict | None = None) -> None:
    out = Path(out)
    doc = {"config": config, "environment": environment, "rows": [dataclasses.asdict(r) for r in rows],
           "skipped": skipped or {}, "cost_model": cost_model}
    atomic_write(out / "results.json", json.dumps(doc, indent=2))
    buf = io.StringIO()
    names = [f.name for f in dataclasses.fields(Row) if f.name not in CSV_SKIP]
    eq_fields = [f.name for f in dataclasses.fields(Equivalence) if f.name != "per_tensor"]  # a dict: JSON only
    eq_names = [f"equivalence_{k}" for k in eq_fields]
    measured_names = [f.name for f in dataclasses.fields(Measured)]
    writer = csv.DictWriter(buf, fieldnames=names + eq_names + measured_names)
    writer.writeheader()
    for r in rows:
        d = {k: getattr(r, k) for k in names}
        d.update({f"equivalence_{k}": getattr(r.equivalence, k) for k in eq_fields})
        d.update(dataclasses.asdict(r.measured))
        writer.writerow(d)
    atomic_write(out / "results.csv", buf.getvalue())


def prepare_out(out: Path) -> None:
    """Create the results folder and prove it is writable before any work starts."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"--out {str(out)!r} is not writable: {e.strerror or e}") from None
