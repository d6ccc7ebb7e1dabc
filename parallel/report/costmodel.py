"""A cost model, calibrated on the machine at hand, that predicts each strategy's step time:

    step = compute on one device's share  +  communication not hidden  +  pipeline bubble

Calibration (all measured in this run, with the loop's clocks):
    compute(b)   one optimiser step of `single` on b samples with one device's threads (on demand)
    copy         device-to-device copy bandwidth, device 0 -> device 1 (activations and replicas; on
                 virtual CPU devices a memory copy on one device's threads)
    alpha, beta  gloo all-reduce latency and seconds per byte, from the all-reduces DDP's child times
                 (4 bytes and every gradient): time(n bytes) = 2(N-1) alpha + 2(N-1)/N n beta
Each strategy owns its formula (`predict_step_ms`); the comparison is predicted beside measured.

The projection to 8, 64 and 1024 GPUs uses a published figure, not this machine: NCCL all-reduce bus
bandwidth on 8xH200 of about 346 GB/s at 64 MiB (stas00/ml-engineering, as quoted in FIELD-NOTES).
It is the time to all-reduce this model's gradients at that bus bandwidth, time = size x 2(N-1)/N /
busbw; it assumes the same bandwidth across nodes, which real clusters rarely reach: an optimistic bound.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from parallel import strategies
from parallel.loop.optim import make_optimizer, tag
from parallel.loop.timing import median_time
from parallel.measure.formulas import model_state, ring_seconds
from parallel.measure.sharded_cost import grad_bytes
from parallel.models.usermodel import workload_of
from parallel.strategies import BASELINE
from parallel.world.devices import synchronizer, synchronizer_all
from parallel.world.dist import Dist

CALIBRATION_BUDGET_S = 2.0  # seconds a batch size's timing may take (median_time); a longer step is reused
PUBLISHED_BUSBW = 346e9  # bytes/s, NCCL all-reduce on 8xH200 at 64 MiB (stas00/ml-engineering)


class Calibration:
    def __init__(self, config, alpha_s: float | None = None, beta_s_per_byte: float | None = None):
        self.config, self.alpha, self.beta = config, alpha_s, beta_s_per_byte
        self.workload = workload_of(config)
        self.model = self.workload.build_model(config.seed)
        self.grad_bytes = grad_bytes(self.model)
        self._compute: dict[int, float] = {}
        self._stages: dict[tuple, tuple[list[float], list[float]]] = {}
        self.scaled: set[int] = set()  # batches whose compute_ms is a measured long step's, in proportion

    def compute_ms(self, batch: int) -> float:
        """Median ms of one `single` optimiser step on `batch` samples, on one device's threads."""
        if batch not in self._compute:
            self._compute[batch] = self._scaled(batch) or self._measure_compute(batch)
        return self._compute[batch]

    def measured(self) -> dict[int, float]:
        return {b: ms for b, ms in self._compute.items() if b not in self.scaled}

    def _scaled(self, batch: int) -> float | None:
        """A step of seconds (over CALIBRATION_BUDGET_S) at another batch, in proportion to it: at that size
        the step is arithmetic, which grows with the batch (GPT-2 small's shape at 2 blocks on this CPU:
        9.1 s at 8 sequences, 4.75 s timed at 4), and timing it again would cost seconds for the same
        answer. results.json keeps them apart (compute_ms_scaled), and the planner's fit sees none."""
        long = [(b, ms) for b, ms in self._compute.items() if b not in self.scaled and ms > 1e3 * CALIBRATION_BUDGET_S]
        if not long:
            return None
        measured, ms = max(long)
        self.scaled.add(batch)
        return ms * batch / measured

    def _measure_compute(self, batch: int) -> float:
        single, device = strategies.get(strategies.BASELINE), self.config.spec.device(0)
        with _threads(self.config.spec.threads_per_device()):
            model = self.workload.build_model(self.config.seed)
            tag(model, self.workload.classes)
            t = single.setup(model, make_optimizer(self.config), self.workload.loss, Dist(device=device), self.config)
            x, y = self.workload.dataset(self.config.seed, batch).batch(0)
            return median_time(lambda: single.train_step(t, (x, y), None), 7, synchronizer(device),
                               budget_s=CALIBRATION_BUDGET_S) * 1e3  # 7 runs, or fewer of a step of seconds

    def stage_ms(self, bounds: list[int], micro: int) -> tuple[list[float], list[float]]:
        """(forward ms, backward ms) of each pipeline stage layers[bounds[i]:bounds[i+1]] on a micro-batch
        of `micro` samples, on one device's threads."""
        key = (tuple(bounds), micro)
        if key not in self._stages:
            from parallel.kit.stages import layers_of, measure_stages

            x = self.workload.dataset(self.config.seed, micro).batch(0)[0]
            with _threads(self.config.spec.threads_per_device()):
                fwd, bwd = measure_stages(layers_of(self.model), bounds, x, self.config.spec.device(0))
            self._stages[key] = ([f * 1e3 for f in fwd], [b * 1e3 for b in bwd])
        return self._stages[key]

    @property
    def overlaps(self) -> bool:
        """Whether collectives run beside compute. nccl runs them on a stream of their own while backward
        goes on; gloo on virtual CPU devices shares the cores the ranks already fill, so it adds whole."""
        return self.config.spec.real

    @functools.cached_property
    def copy_bytes_per_s(self) -> float:
        """What moving activations between stages (or replicas to devices) costs: the real copy from
        device 0 to device 1, not a same-device clone (which on a GPU measures its memory, not the link)."""
        spec = self.config.spec
        src, dst = spec.device(0), spec.device(min(1, self.config.world_size - 1))
        with _threads(spec.threads_per_device()):
            x = torch.empty(16 * 2**20 // 4, device=src)
            copy_ms = median_time(lambda: x.to(dst, copy=True), 7, synchronizer_all([src, dst])) * 1e3
            return x.numel() * 4 / (copy_ms / 1e3)

    def copy_ms(self, nbytes: float) -> float:
        return nbytes / self.copy_bytes_per_s * 1e3

    def allreduce_ms(self, nbytes: float, world: int) -> float | None:
        if self.alpha is None or self.beta is None or world < 2:
            return None if world >= 2 else 0.0
        return ring_seconds("all_reduce", nbytes, world, self.alpha, self.beta) * 1e3  # the planner's ring

    def projection(self) -> dict[int, float]:
        """µs to all-reduce this model's gradients at the published bus bandwidth, by GPU count."""
        return {n: self.grad_bytes * 2 * (n - 1) / n / PUBLISHED_BUSBW * 1e6 for n in (8, 64, 1024)}


# Model state per GPU in the ZeRO paper's setting (Rajbhandari et al., SC 2020, section 3): mixed-precision
# Adam, 2 bytes of fp16 parameters + 2 of fp16 gradients + K = 12 of fp32 copy, momentum and variance per
# parameter, Psi parameters over N GPUs. Activations, buffers and fragmentation come on top.
# formulas.model_state, the planner's (whose own default counts Megatron's fp32 gradients: 18 bytes).
ZERO_STAGES = {"DDP (no sharding)": 0, "ZeRO-1 (zero)": 1, "ZeRO-2 (zero --zero-stage 2)": 2, "ZeRO-3 (FSDP)": 3}
ZERO_MODEL_STATE = {name: (lambda psi, n, stage=stage: sum(model_state(psi, stage, n, 2, 2, 12).values()))
                    for name, stage in ZERO_STAGES.items()}
GPU_COUNTS = (8, 64, 1024)


def memory_projection(params: float, capacity_gib: float = 80.0) -> dict:
    """Model state per GPU for a model of `params` parameters at 8, 64 and 1024 GPUs, by ZeRO stage, and
    the fewest GPUs (a power of two up to 1024) at which it fits `capacity_gib`: a formula, not measured."""
    by_stage, fits_from = {}, {}
    for stage, bytes_per_gpu in ZERO_MODEL_STATE.items():
        by_stage[stage] = {n: bytes_per_gpu(params, n) / 2**30 for n in GPU_COUNTS}
        fits_from[stage] = next((2**k for k in range(11) if bytes_per_gpu(params, 2**k) <= capacity_gib * 2**30), None)
    return {"what": "model state per GPU, GiB, mixed-precision Adam (ZeRO paper); activations not included",
            "params": params, "capacity_GiB": capacity_gib, "GiB_by_stage": by_stage, "fits_from_gpus": fits_from}


def fit_alpha_beta(small_ms: float, large_ms: float, large_bytes: float, world: int) -> tuple[float, float]:
    """alpha, beta (seconds) from a 4-byte and a `large_bytes` all-reduce on `world` ranks."""
    alpha = small_ms / 1e3 / (2 * (world - 1))
    beta = max(0.0, (large_ms / 1e3 - 2 * (world - 1) * alpha) / (2 * (world - 1) / world * large_bytes))
    return alpha, beta


class _threads:
    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def apply(rows, chosen, config, environment: dict | None = None) -> dict:
    """Calibrate (after the strategies ran, so it disturbs none of them), set every row's
    step_ms_predicted, and return the calibration, the planner's calibration on the same timings (on a GPU
    the planner knows) and the projection for results.json."""
    cal = Calibration(config)
    single = next((r for r in rows if r.strategy == BASELINE and r.status == "ok" and r.step_ms_p50), None)
    if single and single.step_ms_p50 > 1e3 * CALIBRATION_BUDGET_S:  # a step of seconds: timed already, in its row
        cal._compute[config.batch_size] = single.step_ms_p50
    for r in rows:
        m = r.measured
        if m.allreduce_4B_ms and m.allreduce_all_grads_ms and r.world_size > 1:
            cal.alpha, cal.beta = fit_alpha_beta(m.allreduce_4B_ms, m.allreduce_all_grads_ms, cal.grad_bytes,
                                                 r.world_size)
            break
    for (strategy, _, cfg), r in zip(chosen, rows, strict=True):
        if r.status == "ok":
            r.step_ms_predicted = strategy.predict_step_ms(cal, cfg, r)
    planner = planner_calibration(rows, cal, config, environment)
    return ({"planner": planner} if planner else {}) | {"alpha_us": None if cal.alpha is None else cal.alpha * 1e6,
            "beta_ns_per_byte": None if cal.beta is None else cal.beta * 1e9,
            "copy_GB_per_s": cal.copy_bytes_per_s / 1e9,
            "compute_ms_by_batch": cal.measured(),
            "compute_ms_scaled": {b: ms for b, ms in cal._compute.items() if b in cal.scaled},
            "projection": {"what": "all-reduce of this model's gradients per step, microseconds, at the published "
                                   "NCCL bus bandwidth (8xH200, 64 MiB); not measured, optimistic across nodes",
                           "busbw_GB_per_s": PUBLISHED_BUSBW / 1e9,
                           "us_by_gpus": cal.projection()}}


def planner_calibration(rows, cal: Calibration, config, environment: dict | None) -> dict | None:
    """The planner calibrated on this run's own timings, single's row and `compute_ms` at each batch size
    (plan/calibration.py: what `plan --calibrate OUT` reads back from results.json), with a line for the
    report; None on a CPU (no GPU kind: `plan --calibrate OUT --gpu KIND`) or a model at no planner shape."""
    from parallel.plan import calibration
    from parallel.world.errors import ConfigError

    single = next(({"strategy": r.strategy, "status": r.status, "step_ms_p50": r.step_ms_p50,
                    "global_batch": r.global_batch, "twin_blocks": r.twin_blocks}
                   for r in rows if r.strategy == BASELINE and not r.variant), None)
    try:
        result = calibration.of_comparison(dataclasses.asdict(config), environment or {}, single, cal.measured())
    except ConfigError:
        return None
    return result | {"note": calibration.note(result)}
