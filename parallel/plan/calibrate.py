"""`plan --calibrate OUT`: the planner calibrated on a finished comparison's `single` step (plan/calibration.py),
shown and written to OUT/calibration.json; `plan ... --calibration FILE` plans with its scales."""

from __future__ import annotations

import json
import math
from pathlib import Path

from parallel.loop.results import atomic_write
from parallel.plan import calibration
from parallel.plan.hardware import GPUS, Efficiency
from parallel.strategies import BASELINE
from parallel.style.tables import table
from parallel.world.errors import ConfigError

PARTS = ("compute", "optimizer", "overhead")


def read_comparison(folder: str) -> dict:
    path = Path(folder) / "results.json"
    if not path.is_file():
        raise ConfigError(f"{path}: not found (run `compare --out {folder}` first, then calibrate on it)")
    try:
        doc = json.loads(path.read_text())
        doc["config"]["workload"], doc["rows"]  # noqa: B018 (what every results.json has)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a comparison's results.json ({e.__class__.__name__}: {e})") from None
    return doc


def main(args, console) -> int:
    doc = read_comparison(args.calibrate)
    single = next((r for r in doc["rows"] if r.get("strategy") == BASELINE and not r.get("variant")), None)
    cal = calibration.of_comparison(doc["config"], doc.get("environment") or {}, single,
                                    (doc.get("cost_model") or {}).get("compute_ms_by_batch"), args.gpu)
    cal["run"] = str(args.calibrate)
    out = Path(args.calibrate) / "calibration.json"
    atomic_write(out, json.dumps(cal, indent=1) + "\n")
    if args.json:
        print(json.dumps(cal, indent=1))
        return 0
    show(console, cal, out)
    return 0


def show(console, cal: dict, out: Path) -> None:
    m, kind = cal["model"], cal["gpu"]
    print_ = lambda text: console.print(text, highlight=False, markup=False)  # noqa: E731
    print_(f"Calibrating {kind}'s model on {cal['run']}: `single`, {m['name']} ({m['layers']} blocks, width "
           f"{m['hidden']}, {m['vocab']:,} x {m['seq']} tokens, {m['params'] / 1e6:.1f}M parameters), on "
           f"{cal['device']}.")
    if cal["device"] == "the CPU":
        print_(f"A CPU run, calibrated against {kind}'s model: the scales say how far this CPU is from that GPU's "
               f"model, not how an {kind} runs.")
    print_(f"Predicted as compare trained it: {cal['trained']}; its batch as one micro-batch on one GPU "
           f"(Training(optimizer={cal['optimizer']!r}): the bytes its step moves, the weights it keeps).")
    t = table("single: measured and predicted, ms a step", [("batch", "right"), ("measured", "right"),
              ("predicted", "right"), ("error", "right"), ("calibrated", "right"), ("error", "right")])
    for p in cal["points"]:
        t.add_row(str(p["batch"]), f"{p['measured_ms']:.2f}", f"{p['predicted_ms']:.2f}", f"{p['error']:+.1%}",
                  f"{p['calibrated_ms']:.2f}", f"{p['calibrated_error']:+.1%}")
    console.print(t)
    more = "" if len(cal["points"]) > 1 else (" (the split between the two is the planner's: a run with ddp or "
                                              "manual_dp beside single on 2 devices or more times single at each "
                                              "device's share too, and separates them)")
    print_(f"Fit, {cal['fit']}{more}: compute x{cal['compute']:.4g} (the device's own work: matrix products, "
           f"elementwise kernels, the optimizer), overhead x{cal['overhead']:.4g} (each kernel's launch and gap).")
    conv = cal["converted"]
    t = table(f"Converted: the same model at batch {conv['batch']}, calibrated, ms", [("training", "left"),
              ("step", "right"), *((part, "right") for part in PARTS)])
    for name, what in (("compare", "the comparison's"), ("planner", "the planner's own")):
        t.add_row(what, f"{conv[name]['step_ms']:.2f}", *(f"{conv[name][part]:.2f}" for part in PARTS))
    console.print(t)
    print_(f"The planner's own training: {conv['to']}. Wrote {out}; `plan ... --gpu {kind} --calibration {out}` "
           "plans with these scales.")


def load(path: str, gpu: str | None) -> tuple[str, Efficiency, dict]:
    """(kind, its efficiencies scaled, what to say) from a calibration.json; a --gpu of another kind is refused."""
    try:
        cal = json.loads(Path(path).read_text())
        kind, c, o = cal["gpu"], float(cal["compute"]), float(cal["overhead"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--calibration {path}: not a calibration.json from `plan --calibrate` "
                          f"({e.__class__.__name__})") from None
    if kind not in GPUS or not (math.isfinite(c) and math.isfinite(o) and c > 0 and o > 0):
        raise ConfigError(f"--calibration {path}: kind {kind!r}, compute {c:g}, overhead {o:g} are not a calibration")
    if gpu and gpu != kind:
        raise ConfigError(f"--calibration {path} calibrates {kind}, not --gpu {gpu}: give --gpu {kind} or another file")
    return kind, GPUS[kind].efficiency.scaled(c, o), {"file": path, "gpu": kind, "compute": c, "overhead": o,
                                                      "device": cal.get("device", "")}
