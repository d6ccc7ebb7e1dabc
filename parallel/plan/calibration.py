"""The planner calibrated on a measured step: `compare`'s `single` (its row, and the cost model's timings of it
at other batch sizes) predicted with compare's own training, and Efficiency.scaled's two factors fitted to it.

    measured(b)  =  predict(the run's model, one GPU, micro-batch b, compare's training; the kind's
                    efficiencies scaled: device work x c, per-kernel costs x o)

One calibration, not two: report/costmodel.py times `single` per batch size for the report's "pred."
column; `plan --calibrate OUT` (plan/calibrate.py) and the report's planner note (costmodel.apply) both read
those timings and single's row through `of_comparison` here, and neither times anything of its own.
docs/planner.md, "Calibrating on your own GPU".
"""

from __future__ import annotations

import dataclasses
import math
import re
import statistics
from collections.abc import Callable

from parallel.plan.cost import predict
from parallel.plan.hardware import GPUS, Cluster, Gpu
from parallel.plan.layouts import Layout, Training
from parallel.plan.models import ModelShape
from parallel.plan.stacks import STACKS
from parallel.world.errors import ConfigError

# What the planner assumes a run trains with (layouts.Training's defaults), and what compare trains with
# (train.make_optimizer, train.precision), in words for the output and calibration.json.
PLANNER_TRAINING = ("Adam in mixed precision (16-bit weights, an fp32 master copy and two moments: 30 bytes "
                    "a parameter a step)")
COMPARE_PRECISION = {"bf16": "bf16 autocast over fp32 weights and gradients (matrix products in bf16)",
                     "fp32": "fp32"}
COMPARE_OPTIMIZER = {"sgd-momentum": "SGD with momentum over fp32 weights, 32 bytes a parameter a step",
                     "sgd": "SGD without momentum over fp32 weights, 12 bytes a parameter a step",
                     "adamw-fp32": "AdamW over fp32 weights (two fp32 moments), 36 bytes a parameter a step"}


def kind_of(name: str) -> str | None:
    """The planner's kind for a GPU's name as CUDA gives it ("NVIDIA H100 80GB HBM3"); None: not one it knows
    (a GH200, an L4...). PCIe and NVL cards map to their SXM kind: the calibration takes up the difference."""
    n = name.upper().replace(" ", "")
    if re.search(r"(^|[^G])H200", n):
        return "h200"
    if "H100" in n and "GH" not in n:
        return "h100"
    if "B200" in n and "GB200" not in n:
        return "b200"
    if "A100" in n and ("40GB" in n or "80GB" in n):
        return "a100-40gb" if "40GB" in n else "a100-80gb"
    return None


def shape_of(config: dict, layers: int = 0) -> ModelShape:
    """compare's built-in transformer as the planner's ModelShape (`layers`: a shallow twin's blocks instead)."""
    shaped = config.get("preset") or config.get("arch")
    if config.get("model") or config.get("workload") != "transformer" or not shaped:
        what = config.get("model") or config.get("workload") or "an unknown workload"
        what = "the default (toy) transformer" if what == "transformer" else what
        raise ConfigError(f"the run trained {what}, not the built-in transformer at a planner shape: calibrate on "
                          "`compare --preset gpt2-small` (or --arch gpt|llama --layers --hidden --heads ...)")
    arch, h = config.get("arch") or "gpt", int(config["hidden"])
    ffn = config.get("ffn") or (4 * h if arch == "gpt" else -(-8 * h // 3 // 64) * 64)  # transformer.Block's
    try:
        return ModelShape(layers or int(config["layers"]), h, int(config["heads"]), int(config["vocab"]),
                         int(config["seq_len"]), ffn, int(config.get("kv_heads") or 0), arch=arch,
                         name=config.get("preset") or arch, tied=bool(config.get("tied")) if arch == "gpt" else None)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"the run's shape is not one the planner reads ({e})") from None


def compare_training(config: dict, batch: int) -> Training:
    """compare's step as the planner's Training: its optimizer (AdamW, or SGD with momentum unless
    --momentum 0, over fp32 weights), its precision, its batch as one micro-batch, on torch's eager stack."""
    optimizer = "adamw-fp32" if config.get("optimizer") == "adamw" else \
        "sgd-momentum" if config.get("momentum", 0.9) else "sgd"
    return Training(batch, config["precision"], optimizer=optimizer, **STACKS["torch"])


def planner_training(batch: int) -> Training:
    return Training(batch, "bf16", **STACKS["torch"])


def step(spec: ModelShape, train: Training, gpu: Gpu, compute: float = 1.0, overhead: float = 1.0) -> dict:
    """The planner's prediction of one GPU's step on train.global_batch sequences, its efficiencies scaled."""
    scaled = dataclasses.replace(gpu, efficiency=gpu.efficiency.scaled(compute, overhead))
    return predict(spec, Layout(mbs=train.global_batch), train, Cluster(scaled, 1, 1))


def fit(points: list[tuple[int, float]], predict_ms: Callable[[int, float, float], float]) -> tuple[float, float, str]:
    """(compute c, overhead o, how) making predict_ms(b, c, o) the measured ms of each (b, ms) point. One
    point: c = o, one common factor. More: least squares on the log of predicted over measured (two: exact,
    where the model can reach both). One GPU's step is homogeneous in (c, o), max(c d + o g, o l) a piece,
    so for each ratio r = o / c the best c is a mean, and the search is over r alone: a grid of 0.2 in ln r
    from 1e-10 to 1e10, then golden sections. Where the points cannot tell the two apart (all launch-bound,
    say), a vanishing pull towards r = 1 keeps them in the planner's own proportion."""
    logs = [math.log(ms) for _, ms in points]
    if len(points) == 1:
        k = points[0][1] / predict_ms(points[0][0], 1.0, 1.0)
        return k, k, "one point: compute and overhead scaled by one common factor"

    def cost(lr: float) -> tuple[float, float]:  # ln(o / c) -> (ln c, squared log errors + the pull)
        pred = [math.log(predict_ms(b, 1.0, math.exp(lr))) for b, _ in points]
        lc = statistics.fmean(m - p for m, p in zip(logs, pred, strict=True))
        return lc, sum((m - p - lc) ** 2 for m, p in zip(logs, pred, strict=True)) + 1e-9 * lr * lr

    grid = [i / 5 for i in range(-115, 116)]
    best = min(range(len(grid)), key=lambda i: cost(grid[i])[1])
    lo, hi = grid[max(0, best - 1)], grid[min(len(grid) - 1, best + 1)]
    g = (math.sqrt(5) - 1) / 2
    for _ in range(60):  # golden sections down to 1e-12 in ln r
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if cost(a)[1] < cost(b)[1] else (a, hi)
    lr = (lo + hi) / 2
    lc = cost(lr)[0]
    if len(points) == 2:
        how = "two points: exact" if cost(lr)[1] < 1e-8 else \
            "two points: as close as the model comes (their ratio is beyond what it can give)"
    else:
        how = f"{len(points)} points: least squares on the log error"
    return math.exp(lc), math.exp(lc + lr), how


def points_of(single: dict, compute_ms_by_batch: dict | None) -> list[tuple[int, float]]:
    """single's (batch, ms), then the cost model's timings of `single` at other batch sizes (none for a
    shallow twin's row: those timed the whole model)."""
    batch = int(single["global_batch"])
    out = [(batch, float(single["step_ms_p50"]))]
    if not single.get("twin_blocks"):
        out += sorted((int(b), float(ms)) for b, ms in (compute_ms_by_batch or {}).items() if int(b) != batch and ms)
    return out


def kind_of_run(config: dict, environment: dict, gpu: str | None) -> tuple[str, str]:
    """(the planner's kind to calibrate, the device `single` ran on in words): the GPU's own kind, or on a
    CPU the kind --gpu names. A --gpu that is not the run's GPU is refused."""
    devices = str(environment.get("devices") or config.get("devices") or "")
    if devices.startswith("cpu"):
        if not gpu:
            raise ConfigError(f"the run was on the CPU ({devices}): name the GPU kind whose model to calibrate "
                              f"against, --gpu {'|'.join(GPUS)}")
        return gpu, "the CPU"
    index = int(m.group(1)) if (m := re.match(r"cuda:(\d+)", devices)) else 0
    gpus = environment.get("gpus") or []
    name = next((g.get("name", "") for g in gpus if g.get("index") == index), gpus[0].get("name", "") if gpus else "")
    kind = kind_of(name)
    if kind is None and not gpu:
        raise ConfigError(f"the run's GPU ({name or 'unnamed'}) is not a kind the planner knows: give --gpu KIND "
                          f"({'|'.join(GPUS)}) to calibrate that kind's model on it")
    if kind and gpu and gpu != kind:
        raise ConfigError(f"--gpu {gpu}, but the run was on an {name} ({kind}): leave --gpu out, or give --gpu {kind}")
    return kind or gpu, name


def of_comparison(config: dict, environment: dict, single: dict | None, compute_ms_by_batch: dict | None,
                  gpu: str | None = None) -> dict:
    """Everything a calibration says: the kind, c and o and how they were fitted, each point measured,
    predicted before and after, and the conversion to the planner's own training at single's batch."""
    if not single or single.get("status") != "ok" or not single.get("step_ms_p50"):
        raise ConfigError("the run has no finished `single` row to calibrate on: compare --strategies single ...")
    spec = shape_of(config, int(single.get("twin_blocks") or 0))
    kind, device = kind_of_run(config, environment, gpu)
    if config.get("precision") not in COMPARE_PRECISION:
        raise ConfigError(f"--precision {config.get('precision')}: the planner models bf16 and fp32 runs")
    if config["precision"] == "fp32" and device != "the CPU":
        raise ConfigError("an fp32 run on a GPU multiplies in IEEE fp32 (compare turns TF32 off), a rate the planner "
                          "has no figure for: calibrate on `compare --precision bf16`")
    points = points_of(single, compute_ms_by_batch)
    ms = lambda b, c, o: step(spec, compare_training(config, b), GPUS[kind], c, o)["step_s"] * 1e3  # noqa: E731
    c, o, how = fit(points, ms)
    rows = []
    for b, measured in points:
        before, after = ms(b, 1.0, 1.0), ms(b, c, o)
        rows.append({"batch": b, "measured_ms": measured, "predicted_ms": before, "error": before / measured - 1,
                     "calibrated_ms": after, "calibrated_error": after / measured - 1})
    batch = points[0][0]
    parts = {name: step(spec, train, GPUS[kind], c, o) for name, train in
             (("compare", compare_training(config, batch)), ("planner", planner_training(batch)))}
    train = compare_training(config, batch)
    return {"gpu": kind, "device": device, "compute": c, "overhead": o, "fit": how, "points": rows,
            "optimizer": train.optimizer, "precision": train.precision,
            "model": {k: v for k, v in dataclasses.asdict(spec).items() if v is not None} | {"params": spec.params},
            "trained": f"{COMPARE_OPTIMIZER[train.optimizer]}, {COMPARE_PRECISION[train.precision]}",
            "converted": {"batch": batch, "to": PLANNER_TRAINING} |
                         {name: {"step_ms": r["step_s"] * 1e3} | {k: v * 1e3 for k, v in r["parts_s"].items()}
                          for name, r in parts.items()}}


def note(cal: dict) -> str:
    """One line for the report: how far the planner was from single's step, and what it says once calibrated."""
    p, conv = cal["points"][0], cal["converted"]
    scales = (f"compute and overhead x{cal['compute']:.3g} together" if cal["compute"] == cal["overhead"] else
              f"compute x{cal['compute']:.3g}, overhead x{cal['overhead']:.3g}")
    return (f"planner (plan --calibrate OUT): single's {p['measured_ms']:.1f} ms at batch {p['batch']} predicted "
            f"{p['predicted_ms']:.1f} by {cal['gpu']}'s model ({p['error']:+.0%}); calibrated on {len(cal['points'])} "
            f"point{'s' * (len(cal['points']) > 1)} ({scales}): {p['calibrated_ms']:.1f} ms; Adam in mixed precision "
            f"at the same batch: {conv['planner']['step_ms']:.1f} ms.")
