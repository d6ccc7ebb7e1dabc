"""Every fitted constant of the planner, fitted again from the rows it names: `python -m parallel.plan.evidence.fit`.

- nanotron's stack (stacks.NANOTRON) on the Ultra-Scale Playbook's one-node H100 rows (playbook.py), and
  nothing else of that sweep: its time constants on the tokens/s of the rows that ran, its memory constants
  on their memory, the memory it calls usable on which rows ran and which crashed. Then leave one model out:
  the same fit on the other models' rows, scored on the model left out.
- the A100's efficiencies (hardware.Efficiency) on Korthikanti et al.'s Table 5 alone: a grid, whose best
  the code's values are held within 0.2 points of (Table 5 does not pin them down).
- one H100's host time per kernel on the bare loop's micro-batches 1 and 4 (published.H100_GPT2_SMALL).

Each fit is a grid search, coarse then fine, on a named error; --check compares the result with the
constants in the code (tests/test_plan_fit.py runs it).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import itertools
import json
import math
import statistics

from parallel.plan.evidence import playbook as pb
from parallel.plan.hardware import GPUS, cluster
from parallel.plan.layouts import Training
from parallel.plan.memory import usable_gib
from parallel.plan.stacks import STACKS

H100 = cluster(8, "h100")
TIME = ("elementwise", "host")
MEMORY = ("activation_scale",)
CAP = math.log(2)  # a row's |log error| counts at most this much: one run far off (an allocator in retries,
#                   8B pp2 dp4 ran at 16.6% MFU beside 41-45%) must not steer every constant


def time_error(pairs) -> float:
    """Mean |log(predicted / measured)| tokens/s over the rows that ran, each capped at CAP."""
    return statistics.fmean(min(CAP, abs(math.log(p["tokens_per_s_per_gpu"] / r.tok_s_gpu))) for r, p in pairs if r.ran)


def memory_error(pairs) -> float:
    return statistics.fmean(min(CAP, abs(math.log(p["memory_gib"]["total"] / r.mem_gib))) for r, p in pairs if r.ran)


def _grid(runs, base: dict, names: tuple[str, ...], axes: list[list[float]], error) -> dict:
    best = None
    for values in itertools.product(*axes):
        stack = base | dict(zip(names, values, strict=True))
        e = error(pb.predict_all([r for r in runs if r.ran], stack))
        if best is None or e < best[0]:
            best = (e, values)
    return dict(zip(names, best[1], strict=True))


def _refine(runs, base, names, coarse: dict, steps: dict, error) -> dict:
    axes = [[round(coarse[n] + k * steps[n], 6) for k in range(-4, 5)] for n in names]
    return _grid(runs, base, names, axes, error)


def fit_nanotron(runs: list[pb.Run]) -> dict:
    """nanotron's fitted constants from `runs` (some of which ran, and some crashed): time (elementwise,
    host) on the tokens/s of those that ran, memory (activation_scale) on their memory, then memory_usable
    (fit_usable) on all of them."""
    if not any(r.ran for r in runs):
        raise ValueError("no row ran: nothing to fit time or memory on")
    base = dict(STACKS["nanotron"])
    coarse = _grid(runs, base, TIME, [[x / 2 for x in range(2, 17)], [x / 4 for x in range(2, 17)]], time_error)
    base |= _refine(runs, base, TIME, coarse, {"elementwise": 0.1, "host": 0.05}, time_error)
    coarse = _grid(runs, base, MEMORY, [[1 + x / 10 for x in range(0, 11)]], memory_error)
    base |= _refine(runs, base, MEMORY, coarse, {"activation_scale": 0.02}, memory_error)
    return {k: base[k] for k in (*TIME, *MEMORY)} | {"memory_usable": fit_usable(pb.predict_all(runs, base), base)}


def fit_usable(pairs, stack: dict) -> float:
    """The share of a GPU's memory a layout may be predicted to need and be called fitting: the one whose
    picks lose least (the choice is what a user came for); of those, the one with the fewest rows
    misclassified (the share of crashed rows called fitting plus the share of rows that ran called out of
    memory); of those, the middle one. `stack`: the stack being fitted (the memory no tensor holds is its)."""
    def score(u):
        limit = usable_gib(H100.gpu.memory_gib, Training(1, **(stack | {"memory_usable": u})))
        s = pb.score([(r, p | {"fits": p["memory_gib"]["total"] <= limit and "refused" not in p})
                      for r, p in pairs])["summary"]
        return (round(s["pick_loss_mean"] or 0.0, 6),
                round((s["crashed_called_fits"] or 0.0) + (s["ran_called_oom"] or 0.0), 6))
    grid = [k / 1000 for k in range(700, 1001, 5)]
    scores = {u: score(u) for u in grid}
    best = [u for u in grid if scores[u] == min(scores.values())]
    return best[len(best) // 2]


def leave_one_model_out(runs: list[pb.Run]) -> dict:
    """For each model that ran: the constants fitted without its rows, and the scores on its rows alone.
    Seconds of fitting on the same rows give the same answer: once a process (`plan --validate` and its
    tests ask again), a copy to each caller."""
    return copy.deepcopy(_leave_one_model_out(tuple(runs)))


@functools.cache
def _leave_one_model_out(runs: tuple[pb.Run, ...]) -> dict:
    out = {}
    for model in dict.fromkeys(r.model for r in runs if r.ran):
        fitted = fit_nanotron([r for r in runs if r.model != model])
        pairs = pb.predict_all([r for r in runs if r.model == model], STACKS["nanotron"] | fitted)
        out[model] = {"constants": fitted, "score": pb.score(pairs)["summary"]}
    return out


def fit_a100() -> dict:
    """The A100's efficiencies on Korthikanti Table 5 alone: a grid over mm_max, mm_half, memory and nvlink,
    the mean |error| of each, the best, and where the code's values stand among them (Table 5's 8 rows do
    not pin the four down: many corners are within a few tenths of a point of the best); then leave one row
    out: the corner best on the other 7, its error on the row left out."""
    from parallel.plan.evidence import validate as v

    base = GPUS["a100-80gb"].efficiency
    grid = []
    for mm_max, half, memory, nvlink in itertools.product((0.7, 0.75, 0.8, 0.85, 0.9), (25, 50, 75, 100),
                                                           (0.8, 0.85, 0.9, 0.95), (0.55, 0.6, 0.65, 0.7, 0.75)):
        e = dataclasses.replace(base, mm_max=mm_max, mm_half=half, memory=memory, nvlink=nvlink)
        errors = [abs(r["error"]) for r in v.table5(e)]
        grid.append((statistics.fmean(errors), errors, {"mm_max": mm_max, "mm_half": half, "memory": memory,
                                                        "nvlink": nvlink}))
    grid.sort(key=lambda x: x[0])
    rows = len(grid[0][1])
    loo = [min(grid, key=lambda g: statistics.fmean(g[1][:i] + g[1][i + 1:]))[1][i] for i in range(rows)]
    return {"rows": f"Korthikanti et al. 2022, Table 5 ({rows} rows)", "best": grid[0][2],
            "best_mean_error": grid[0][0], "in_code": {k: getattr(base, k) for k in grid[0][2]},
            "in_code_mean_error": v.summary(v.table5())["mean"],
            "within_0.2_points_of_best": sum(1 for x, *_ in grid if x <= grid[0][0] + 0.002), "grid": len(grid),
            "leave_one_out": {"errors": loo, "mean": statistics.fmean(loo), "worst": max(loo)}}


def fit_h100_host() -> dict:
    """One H100's host seconds per kernel (Efficiency.launch_s) on the bare loop's micro-batches 1 and 4
    (published.H100_GPT2_SMALL), the two its host sets (micro-batch 16 is the GPU's): a grid of 1 µs on the
    squared log error, torch's stack with its profiled elementwise share. Leave one out: launch_s fitted on
    one of the two, the other's error; that run's calibration (compute, overhead) fitted on two of its three
    steps, the third's error."""
    from parallel.plan import calibration
    from parallel.plan.evidence import published as pub
    from parallel.plan.models import PRESETS
    from parallel.plan.stacks import STACKS

    steps = pub.H100_GPT2_SMALL

    def ms(b, c=1.0, o=1.0, gpu=GPUS["h100"]):
        return calibration.step(PRESETS["gpt2-small"], Training(b, "bf16", **STACKS["torch"]), gpu, c,
                                o)["step_s"] * 1e3

    def error(us, i):
        gpu = dataclasses.replace(GPUS["h100"], efficiency=dataclasses.replace(GPUS["h100"].efficiency,
                                                                               launch_s=us * 1e-6))
        return ms(steps[i][0], gpu=gpu) / steps[i][1] - 1

    def best(points):
        return min(range(10, 61), key=lambda us: sum(math.log1p(error(us, i)) ** 2 for i in points))
    launch_loo = [abs(error(best([1 - i]), i)) for i in (0, 1)]
    calibrated_loo = []
    for i, (b, measured) in enumerate(steps):
        c, o, _ = calibration.fit(steps[:i] + steps[i + 1:], ms)
        calibrated_loo.append(abs(ms(b, c, o) / measured - 1))
    return {"rows": "one H100, GPT-2 small, bare loop, micro-batches 1 and 4", "launch_s": best([0, 1]) * 1e-6,
            "in_code": GPUS["h100"].efficiency.launch_s,
            "leave_one_out": {"launch_s": launch_loo, "calibration": calibrated_loo,
                              "mean": statistics.fmean(calibrated_loo), "worst": max(calibrated_loo)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m parallel.plan.evidence.fit", description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 unless the fits give the constants in the code")
    ap.add_argument("--no-loo", action="store_true", help="skip leave-one-model-out (3 more fits)")
    args = ap.parse_args(argv)
    runs, dropped = pb.runs()
    fitted = fit_nanotron(runs)
    report = {"nanotron": {"rows": f"{len(runs)} Playbook one-node rows ({dropped} inconsistent dropped)",
                           "fitted": fitted, "in_code": {k: STACKS["nanotron"][k] for k in fitted}}}
    if not args.no_loo:
        report["nanotron"]["leave_one_model_out"] = leave_one_model_out(runs)
    report["a100"] = fit_a100()
    report["h100_host"] = fit_h100_host()
    print(json.dumps(report, indent=1))
    if args.check:
        same = all(math.isclose(fitted[k], STACKS["nanotron"][k], abs_tol=1e-9) for k in fitted)
        same &= math.isclose(report["h100_host"]["launch_s"], report["h100_host"]["in_code"], rel_tol=1e-9)
        same &= report["a100"]["in_code_mean_error"] <= report["a100"]["best_mean_error"] + 0.002
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

