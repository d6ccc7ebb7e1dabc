"""`plan --validate`: every published row predicted with its own configuration, beside what was measured, each
set with its role (ROLES): held out (nothing was fitted on it), fit (constants were, by fit.py, which names
them), or identity (the source's own formula recomputed). The Ultra-Scale Playbook's one-node sweep comes
first, scored on the choice a user makes (playbook.py)."""

from __future__ import annotations

import dataclasses
import statistics

from parallel.measure.formulas import model_state
from parallel.plan.cost import predict
from parallel.plan.evidence import published as pub
from parallel.plan.hardware import GPUS, Cluster, Efficiency, GiB
from parallel.plan.layouts import Layout, Training
from parallel.plan.models import PRESETS
from parallel.plan.stacks import STACKS

# Each set's role, and what was fitted on it (fit.py reproduces every fitted constant from its rows).
ROLES = {
    "playbook_1node": ("fit", "nanotron's stack: elementwise, host, activation_scale, memory_usable (fit.py); "
                              "leave one model out beside it"),
    "narayanan_table1": ("held out", "nothing fitted on it"),
    "narayanan_table2": ("held out", "nothing fitted on it"),
    "h100_compare_single": ("held out", "compare's single step on one H100: nothing fitted on it"),
    "korthikanti_table5": ("fit", "the A100's efficiencies mm_max, mm_half, memory, nvlink (fit.py)"),
    "single_h100": ("fit", "the H100's launch_s on micro-batches 1 and 4; the rest is that run's calibration"),
    "korthikanti_figure1": ("identity", "the paper's own formula recomputed: 0.0% by construction"),
}

MEGATRON = dict(precision="fp16", attention="unfused", dropout=True, grad_bytes=4, dp_overlap=False)


def selene(gpus: int, efficiency: Efficiency | None = None) -> Cluster:
    gpu = GPUS["a100-80gb"]
    if efficiency is not None:
        gpu = dataclasses.replace(gpu, efficiency=efficiency)
    return Cluster(gpu, gpus, 8)


def table1(efficiency=None) -> list[dict]:
    """Narayanan Table 1: TFLOP/s per GPU as the paper counts them (eq. 3, with recompute)."""
    rows = []
    for params, heads, h, L, tp, pp, gpus, gb, mbs, v, published in pub.NARAYANAN_T1:
        model = pub.gpt(L, h, heads, f"{params}B")
        lay = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=mbs, stages_per_rank=v, recompute="full")
        r = predict(model, lay, Training(gb, **MEGATRON), selene(gpus, efficiency))
        got = pub.narayanan_flops(model, gb) / r["step_s"] / gpus / 1e12
        rows.append({"row": f"{params}B {lay.describe()}", "published": published, "predicted": got,
                     "error": got / published - 1, "what": "TFLOP/s/GPU"})
    return rows


def table5(efficiency=None) -> list[dict]:
    """Korthikanti Table 5: seconds per iteration, full recompute (TP only) and SP + selective."""
    rows = []
    for name, heads, h, L, pp, gpus, mbs, v, full, seqsel, *_ in pub.KORTHIKANTI:
        model = pub.gpt(L, h, heads, name)
        gb = pub.KORTHIKANTI_GLOBAL_BATCH.get(name, gpus)
        for recompute, sp, published in (("full", False, full), ("selective", True, seqsel)):
            lay = Layout(tp=8, pp=pp, dp=gpus // (8 * pp), mbs=mbs, stages_per_rank=v, recompute=recompute,
                         sequence_parallel=sp)
            r = predict(model, lay, Training(gb, **MEGATRON), selene(gpus, efficiency))
            rows.append({"row": f"{name} {'full' if recompute == 'full' else 'SP+selective'}",
                         "published": published, "predicted": r["step_s"], "error": r["step_s"] / published - 1,
                         "what": "s/iteration"})
    return rows


def figure1() -> list[dict]:
    """Korthikanti Figure 1: model state and activations per GPU, GiB (the first stage)."""
    rows = []
    for name, heads, h, L, pp, gpus, mbs, v, *_, state, act_tp, act_seqsel in pub.KORTHIKANTI:
        model = pub.gpt(L, h, heads, name)
        for label, rc, sp, what, published in (("model state, layers", "none", False, "state", state),
                                                ("activations, TP", "none", False, "act", act_tp),
                                                ("activations, SP+selective", "selective", True, "act", act_seqsel)):
            lay = Layout(tp=8, pp=pp, dp=1, mbs=mbs, stages_per_rank=v, recompute=rc, sequence_parallel=sp)
            mem = predict(model, lay, Training(pub.KORTHIKANTI_GLOBAL_BATCH.get(name, gpus), **MEGATRON),
                          selene(gpus))["memory_gib"]
            if what == "act":
                got = mem["activations"]
            else:  # the figure counts a stage's layers, 18 bytes each (its numbers are exactly that): no embedding
                psi = model.layer_params * L / pp / 8
                got = sum(model_state(psi, 0, 1, 2, MEGATRON["grad_bytes"], 12).values()) / GiB
            rows.append({"row": f"{name} {label}", "published": published, "predicted": got,
                         "error": got / published - 1, "what": "GiB/GPU"})
    return rows


def table2(efficiency=None) -> list[dict]:
    """Narayanan Table 2: ZeRO-3 against PTD-P as GPUs double at a fixed global batch."""
    rows = []
    for scheme, name, gpus_, batches, mbs_, (tp, pp), published_ in pub.NARAYANAN_T2:
        model = pub.gpt(*pub.T2_MODELS[name], name)
        for gpus, gb, mbs, published in zip(gpus_, batches, mbs_, published_, strict=True):
            zero = scheme == "ZeRO-3"
            lay = Layout(tp=tp, pp=pp, dp=gpus // (tp * pp), mbs=mbs, recompute="full", zero_stage=3 if zero else 0)
            # DeepSpeed's ZeRO-3 prefetches (overlaps) and reduces gradients in the training dtype, fp16
            train = Training(gb, **(MEGATRON | {"dp_overlap": True, "grad_bytes": 2} if zero else MEGATRON))
            r = predict(model, lay, train, selene(gpus, efficiency))
            got = pub.narayanan_flops(model, gb) / r["step_s"] / gpus / 1e12
            rows.append({"row": f"{scheme} {name} {gpus} GPUs", "scheme": scheme, "model": name, "gpus": gpus,
                         "published": published, "predicted": got, "error": got / published - 1,
                         "what": "TFLOP/s/GPU"})
    return rows


def single_h100(efficiency=None) -> list[dict]:
    """The bare eager loop on GPT-2 small, one H100 (published.H100_GPT2_SMALL), as `plan --gpu h100 --gpus 1
    --mbs N --global-batch N` predicts it on torch's stack: ms a step, measured and predicted; then that run's
    own calibration (calibration.fit on its three steps: what the stack leaves of its residual) and each step
    calibrated, the fit's residuals."""
    from parallel.plan import calibration

    gpu = GPUS["h100"] if efficiency is None else dataclasses.replace(GPUS["h100"], efficiency=efficiency)

    def ms(mbs, c=1.0, o=1.0):
        return calibration.step(PRESETS["gpt2-small"], Training(mbs, "bf16", **STACKS["torch"]), gpu, c, o)
    c, o, _ = calibration.fit(pub.H100_GPT2_SMALL, lambda b, c, o: ms(b, c, o)["step_s"] * 1e3)
    rows = []
    for mbs, measured in pub.H100_GPT2_SMALL:
        r = ms(mbs)
        got, cal = r["step_s"] * 1e3, ms(mbs, c, o)["step_s"] * 1e3
        rows.append({"row": f"gpt2-small mbs {mbs}", "published": measured, "predicted": got,
                     "error": got / measured - 1, "what": "ms/step", "overhead": r["parts_s"]["overhead"] / r["step_s"],
                     "calibration": {"compute": c, "overhead": o}, "calibrated": cal, "residual": cal / measured - 1})
    return rows


def compare_single_h100(bare_loop: list[dict] | None = None) -> list[dict]:
    """compare's own single step on one H100 (published.H100_COMPARE_SINGLE), held out: predicted as compare
    trained it (SGD with momentum over fp32 weights, bf16 autocast, GPT-2 small untied), uncalibrated, and with
    the bare loop's calibration (single_h100's rows, `bare_loop` where the caller has them), a run on the same
    kind of machine."""
    from parallel.plan import calibration

    batch, measured = pub.H100_COMPARE_SINGLE
    spec = dataclasses.replace(PRESETS["gpt2-small"], tied=False)
    train = calibration.compare_training({"precision": "bf16", "momentum": 0.9}, batch)
    scales = (bare_loop or single_h100())[0]["calibration"]
    rows = []
    for label, c, o in (("uncalibrated", 1.0, 1.0), ("the bare loop's calibration", scales["compute"],
                                                     scales["overhead"])):
        got = calibration.step(spec, train, GPUS["h100"], c, o)["step_s"] * 1e3
        rows.append({"row": f"gpt2-small untied, batch {batch}, {label}", "published": measured, "predicted": got,
                     "error": got / measured - 1, "what": "ms/step"})
    return rows


def playbook(path=None, stack: dict | None = None) -> dict:
    """The Playbook's one-node sweep (or `path`, a CSV of the same columns), scored (playbook.score) with
    nanotron's stack, and the rows dropped as inconsistent."""
    from parallel.plan.evidence import playbook as pb

    runs, dropped = pb.runs(path) if path else pb.runs()
    return pb.score(pb.predict_all(runs, stack)) | {"dropped": dropped}


def crossover(rows: list[dict]) -> dict:
    """Per scheme and model, throughput at each GPU count over the first. Reproduced when, as published,
    ZeRO-3 loses half at each doubling (a quarter or less left after two: published 0.31 and 0.35) while
    PTD-P keeps 88% or more (published 0.92, 0.93), and PTD-P is more than twice ZeRO-3 at the most GPUs."""
    out = {}
    for key in dict.fromkeys((r["scheme"], r["model"]) for r in rows):
        mine = [r for r in rows if (r["scheme"], r["model"]) == key]
        out[" ".join(key)] = {k: [r[k] / mine[0][k] for r in mine] for k in ("predicted", "published")}
    last = {r["scheme"] + " " + r["model"]: r["predicted"] for r in rows}  # the most GPUs, per scheme and model
    ok = all(v["predicted"][-1] <= 0.36 for k, v in out.items() if k.startswith("ZeRO"))
    ok &= all(v["predicted"][-1] >= 0.88 for k, v in out.items() if k.startswith("PTD"))
    ok &= all(last[f"PTD-P {m}"] > 2 * last[f"ZeRO-3 {m}"] for m in pub.T2_MODELS)
    return {"ratios": out, "reproduced": ok}


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    return {"mean": statistics.fmean(errors), "worst": max(errors)}
