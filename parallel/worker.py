"""What one strategy's process runs: the harness's children, torchrun's workers and scripts/ alike.

    python -m parallel.worker --strategy single --config cfg.json --result row.json --state params.pt
    torchrun --standalone --nproc_per_node=2 -m parallel.worker --strategy ddp ...

Rank 0 writes the measured part of the result row and the final parameters; the harness adds what
needs other strategies' results (speedup, equivalence).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as td
from torch.distributed.elastic.multiprocessing.errors import record

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit.collectives import every_rank
from parallel.loop import master, muon, recorder
from parallel.loop.clipping import NORM_BYTES, norm_name
from parallel.loop.optim import make_optimizer, tag
from parallel.loop.profiling import make_profiler
from parallel.loop.results import Measured, Row, atomic_write
from parallel.loop.timing import LAUNCHED_AT, summarize
from parallel.loop.tokens import COUNT_BYTES, counts_apart, loss_of
from parallel.loop.train import default_dtype, end_line, precision, start_line, step_lines
from parallel.measure import activations
from parallel.measure.formulas import wire_bytes
from parallel.models.usermodel import their_files, workload_of
from parallel.world.devices import activate, cap_memory, exact_fp32, peak_memory, peak_reserved, reset_peak_memory
from parallel.world.dist import Dist
from parallel.world.errors import THEIRS, error_line, raised_in


@dataclasses.dataclass
class Trained:
    """What one training run leaves for its row: the loop's result, the final parameters, the memory peaks,
    the family's extra measurements and the seconds each phase took."""
    result: object
    trainable: object
    state: dict
    peaks: list
    peak_kind: str
    reserved: list
    extra: dict
    predicted: float | None
    threads_per_device: int
    phases: dict
    loss_names: tuple = ()
    count_bytes: float = 0.0  # what the step's all-reduced count of real targets sends (loop/tokens.density), and
    #   its all-reduced gradient norm (loop/clipping.py): one float64 each


def execute(strategy, config: RunConfig, dist: Dist, data=None, run: str = "") -> tuple[Row, dict]:
    """Train once with `strategy` in this process (one rank of it); returns the row and final parameters.
    `data`: where batches come from (default: SyntheticData; the sweep passes a DataLoader's)."""
    trained = train_once(strategy, config, dist, data, run)
    return build_row(strategy, config, dist, trained), trained.state


def train_once(strategy, config: RunConfig, dist: Dist, data=None, run: str = "") -> Trained:
    """The devices and threads set, the model and data made from the seed, the strategy's setup, THE loop,
    then (off the clock) the final parameters, the memory peaks and the family's extra measurements."""
    began = time.perf_counter()  # the phases' times: where a run's seconds go (a short run is mostly start-up)
    phases = {"start": round(time.time() - float(os.environ.get(LAUNCHED_AT, time.time())), 2)}
    local = devices_driven(strategy, config, dist)
    # The cores are split between devices; this process drives len(local) of them. Set explicitly:
    # torchrun sets OMP_NUM_THREADS=1 in every worker, which would otherwise decide for us.
    threads = config.spec.threads_per_device() * len(local)
    torch.set_num_threads(threads)
    activate(local)  # CUDA initialised (and the rank's device current) before any memory statistic
    exact_fp32(local)  # no TF32 on GPUs: every run is checked against `single` at fp32's tolerances
    if config.memory_cap_mb:
        cap_memory(local, int(config.memory_cap_mb * 2**20))

    workload = workload_of(config)
    with default_dtype(config):  # --precision fp64: the model, its data, every buffer
        model = workload.build_model(config.seed)
        tag(model, workload.classes)  # which parameters decay, decided here, before any wrapper (loop/optim.py)
        if config.precision == "bf16-master":
            master.cast(model)  # bf16 weights from the seed's fp32 ones; fp32 masters in the optimiser
        data = data or workload.dataset(config.seed, config.batch_size)
        predicted = strategy.comm_bytes_predicted(model, config)
        reset_peak_memory(local)
        trainable = strategy.setup(model, make_optimizer(config), loss_of(workload), dist, config)
        trainable.mutant = config.mutant  # the injected bug, if any, that train_step may carry (--mutant)
        if strategy.MEASURE is not None and config.extras:
            strategy.MEASURE.watch(trainable)  # its family counts inside the steps (expert dispatch's rows)
        layer = activations.meter_for(strategy, trainable.model, workload, config)
        phases["setup"], began = round(time.perf_counter() - began, 2), time.perf_counter()
        with make_profiler(config.profile, config.out, run or strategy.name, dist.rank, dist.device) as prof:
            result = strategy.train(strategy, trainable, data, config, dist, prof)
        phases["train"], began = round(time.perf_counter() - began, 2), time.perf_counter()
        with master.published(trainable):  # bf16-master: the fp32 masters are the run's weights
            state = master.whole(trainable, strategy.state_dict(trainable))
        peaks, peak_kind = peak_memory(local)
        reserved = peak_reserved(local)  # CUDA only (the allocator's cache too)
        with precision(config, trainable.device):  # what it times is the run's own step
            extra = strategy.extra_measurements(trainable, data, config, dist, result) if config.extras else {}
            extra |= layer.details(workload.input_shape[0], config.precision) if layer is not None else {}
    phases["extras"] = round(time.perf_counter() - began, 2)
    counted = counts_apart(data, trainable.loss_fn, dist.world_size)  # the step's count, all-reduced (loop/tokens.py)
    normed = getattr(result, "norm_reduced", False)  # the step's global gradient norm, all-reduced (loop/clipping.py)
    small = wire_bytes("all_reduce", COUNT_BYTES, dist.world_size) * counted + \
        wire_bytes("all_reduce", NORM_BYTES, dist.world_size) * normed + \
        sum(wire_bytes("all_gather", size, n) for size, n in muon.gathers(trainable.optimizer))
    return Trained(result, trainable, state, peaks, peak_kind, reserved, extra, predicted, threads // len(local),
                   phases, tuple(workload.loss_names), small)


def build_row(strategy, config: RunConfig, dist: Dist, trained: Trained) -> Row:
    """The row of one run: its times (median and p95), memory, bytes, losses, and every detail in words."""
    result, extra, peak = trained.result, dict(trained.extra), max(trained.peaks)
    measured = extra.pop("measured", Measured())
    typed = {k: v for k, v in extra.items() if dataclasses.is_dataclass(v)}  # the families' Results (measure/)
    extra |= {k: dataclasses.asdict(v) for k, v in typed.items()}  # a dict in the row, read back by result_of
    details = {"model_state_bytes_per_device": strategy.model_state_bytes(trained.trainable, config),
               **({f"{trained.peak_kind}_per_device": trained.peaks} if len(trained.peaks) > 1 else {}),
               **_peak_per_rank(peak, trained.peak_kind, dist), **extra, "phases_s": trained.phases}
    if trained.reserved:
        top = max(trained.reserved)
        details |= {"cuda_max_reserved": top, **_peak_per_rank(top, "cuda_max_reserved", dist)}
    if config.real_copy:  # the parent's check of it ran on a real copy of the user's model (compare.select_runs)
        details["checked_on_a_real_copy"] = config.real_copy
    if result.checked is not None:  # --check-replicas: the steps it compared, and the first disagreement if any
        details["replicas_checked"] = result.checked
    if result.diverged:
        details["replicas_diverged"] = result.diverged
    if why := every_rank_reason(trained.trainable.not_expected, dist):
        details["not_expected"] = why
    predicted = trained.predicted
    for found in typed.values():  # a prediction that needs the run (the experts': from its routing)
        predicted = getattr(found, "comm_bytes_predicted", None) or predicted
    predicted = predicted if predicted is None else predicted + trained.count_bytes  # the count of real targets
    stats = summarize(result.step_s)
    ran = len(result.losses)  # fewer than warmup + steps after a resume
    return Row(
        strategy=strategy.name,
        variant="",
        launcher=strategy.launch,
        devices=str(config.spec),
        device_kind=strategy.kind(config),
        world_size=strategy.world_size(config),
        global_batch=config.batch_size,
        step_ms_p50=stats["p50_ms"],
        update_ms_p50=summarize(getattr(result, "update_s", []))["p50_ms"],
        step_ms_p95=stats["p95_ms"],
        samples_per_s=result.samples_per_s or (stats["p50_ms"] and config.batch_size / (stats["p50_ms"] / 1e3)),
        peak_mem_bytes=peak,
        peak_mem_kind=trained.peak_kind,
        comm_bytes_per_step=result.wire.total / (result.wire.counted or ran) if ran and strategy.SENDS_SEEN else None,
        comm_bytes_predicted=predicted,
        final_loss=result.losses[-1] if ran else None,
        threads_per_device=trained.threads_per_device,
        losses=result.losses,
        loss_parts=dict(zip(trained.loss_names, map(list, zip(*result.loss_parts, strict=True)), strict=True))
        if result.loss_parts else {},
        step_ms=[s * 1e3 for s in result.step_s],
        grad_norms=getattr(result, "grad_norms", {}),
        measured=measured,
        details=details,
    )


def every_rank_reason(reason: str, dist: Dist) -> str:
    """The first rank's reason, of those that have one, that its run cannot match `single` (a collective;
    an in-process strategy inside a bigger group, as the oracle runs it, is a world of one)."""
    return next((r for r in (every_rank(reason) if dist.world_size > 1 else [reason]) if r), "")


def devices_driven(strategy, config: RunConfig, dist: Dist) -> list[torch.device]:
    """Every device this process drives: its rank's one under torchrun; every device of the strategy
    for the in-process ones (manual_dp, data_parallel, model_parallel, pipeline drive several)."""
    if strategy.launch == "torchrun":
        return [dist.device]
    return [config.spec.device(i) for i in range(strategy.world_size(config))]


def _peak_per_rank(peak: int, kind: str, dist: Dist) -> dict:
    """Every rank's peak memory, gathered to all (off the clock), when this run has several ranks (an
    in-process strategy run inside a bigger group, as the oracle's runs do, is a world of one)."""
    if dist.world_size == 1 or not td.is_initialized():
        return {}
    return {f"{kind}_per_rank": every_rank(peak)}


def run_here(strategy, config: RunConfig, dist: Dist | None = None, run: str = "") -> tuple[Row, dict] | None:
    """Join the process group if the strategy needs one, execute, tear down. Rank 0 gets the result."""
    dist = dist or Dist.from_env(config.spec)
    strategy.validate(config)  # a bad option fails here, before any process group
    needs_group = strategy.launch == "torchrun"
    if needs_group:
        recorder.enable()  # torch's Flight Recorder: on before the first process group
        if config.debug_collectives:  # every collective checked across the ranks (the group made next wraps)
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # its children's, and the level, read at import:
            td.set_debug_level(td.DebugLevel.DETAIL)  # torch.distributed is imported by now (the zygote's)
        dist.init(config.pg_timeout)
    folder = hang_folder(strategy, config)
    try:  # this rank's last collectives, written on an error for the parent's diagnosis (judge/hangs.py)
        with recorder.recording(folder, dist.rank, config.pg_timeout) if needs_group else contextlib.nullcontext():
            row, state = execute(strategy, config, dist, run=run)
    except BaseException:
        if needs_group and HANG_DIR not in os.environ:  # a script under a plain torchrun: no parent reads them
            print(f"[rank{dist.rank}]: its record of collectives: {folder}/ (python -m parallel diagnose "
                  f"{folder})", file=sys.stderr, flush=True)
        raise
    finally:
        if needs_group:
            dist.cleanup()
    return (row, state) if dist.is_main else None


HANG_DIR = "PARALLEL_HANG_DIR"  # where the harness wants the ranks' records (OUT/hang/<run>/)


def hang_folder(strategy, config: RunConfig) -> Path:
    """Where this run's ranks write their records of collectives on a failure or a stall: the harness's
    choice (OUT/hang/<run>/), else OUT/hang/<strategy>/ (a script under a plain torchrun)."""
    return Path(os.environ.get(HANG_DIR) or Path(config.out or "results") / "hang" / strategy.name)


@record  # under torchrun: the rank's traceback goes to torchrun's error file, and its summary names the rank
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.worker", description=__doc__)
    p.add_argument("--strategy", required=True)
    p.add_argument("--config", required=True, type=Path, help="RunConfig as JSON, already validated")
    p.add_argument("--result", required=True, type=Path, help="where rank 0 writes its row (JSON)")
    p.add_argument("--state", required=True, type=Path, help="where rank 0 writes the final parameters")
    p.add_argument("--tb-run", default="", help="its folder in OUT/tb/ for profiler traces (default: the strategy's)")
    args = p.parse_args(argv)
    config = RunConfig.from_json(args.config.read_text()).validate()
    strategy = strategies.get(args.strategy)
    dist = Dist.from_env(config.spec)
    if dist.is_main:  # stdout, which the harness writes to OUT/logs/<strategy>.log (launch.run_child)
        say(start_line(strategy, config, dist))
    try:
        out = run_here(strategy, config, dist, args.tb_run)
    except Exception as e:
        if strategy.launch == "torchrun":
            note_failure(args.result, dist, e)
        elif raised_in(e, theirs := their_files()):  # the user's model or data code raised it: the row says where
            print(f"{THEIRS}{error_line(e, theirs)}", file=sys.stderr, flush=True)
        raise
    if out is not None:
        row, state = out
        torch.save(state, args.state)
        atomic_write(args.result, json.dumps(dataclasses.asdict(row)))
        parts = {**row.loss_parts, **{norm_name(k): v for k, v in row.grad_norms.items()}}
        for line in [*step_lines(row.losses, row.step_ms, config.warmup, config.steps, parts),
                     end_line(row)]:  # after the run, from what the loop recorded: nothing inside a timed step
            say(line)
    if strategy.launch == "torchrun":
        leave(0)
    return 0


def note_failure(result: Path, dist: Dist, e: Exception) -> None:
    """This rank's failure and its moment, beside the result (launch.first_failure reads them): torchrun's
    summary times failures to the second and names the lowest rank on a tie, so a rank that failed
    because a peer died a few ms before could be named in its place (seen with forked workers)."""
    note = {"rank": dist.rank, "restart": dist.restart, "time": time.time(), "error": error_line(e, their_files())}
    atomic_write(result.with_name(f"{result.stem}.failure{dist.rank}.json"), json.dumps(note))


def say(line: str) -> None:
    print(line, flush=True)


def leave(code: int) -> NoReturn:
    """End a torchrun worker that has finished, without the interpreter's teardown. torch.distributed's
    C++ threads still joinable when static destructors run abort the process ("terminate called without
    an active exception", FIELD-NOTES): seen here on rank 1, which finishes first, in 4 of about 25 DDP
    launches of one test-suite run, and torchrun then killed rank 0 before it wrote its result. By now
    the process group is destroyed and every file is written and closed (atomic writes); stdio is flushed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    raise SystemExit(main())
