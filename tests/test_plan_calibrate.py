"""`plan --calibrate OUT`: the planner fitted to a comparison's measured `single` step (the H100 fixture, and
small synthetic results.json files), the conversion to the planner's own training, `--calibration FILE`, and
the same calibration in the comparison's report. Nothing trains here."""

import copy
import dataclasses
import json
import types

import pytest

from parallel import cli
from parallel.config import RunConfig
from parallel.models.transformer import Transformer
from parallel.plan import calibration, cost
from parallel.plan.evidence import validate
from parallel.plan.hardware import GPUS, Cluster
from parallel.plan.layouts import Layout, Training
from parallel.plan.models import ModelShape
from parallel.report import costmodel, notes

pytestmark = pytest.mark.timeout(120)
H100 = json.loads(open("tests/data/h100_gpt2_small_results.json").read())  # a real H100 run, stopped: no cost_model


def folder(tmp_path, doc):
    out = tmp_path / f"run{len(list(tmp_path.iterdir()))}"  # a fresh folder for each
    out.mkdir()
    (out / "results.json").write_text(json.dumps(doc))
    return out


def synthetic(c: float, o: float, batches=(4, 8), noise=(1.0, 1.0, 1.0)) -> dict:
    """The H100 run with its single step and cost-model timings at `batches` made by the planner itself with
    efficiencies scaled by (c, o), each times its `noise` factor."""
    doc = copy.deepcopy(H100)
    spec = calibration.shape_of(doc["config"])
    ms = [calibration.step(spec, calibration.compare_training(doc["config"], b), GPUS["h100"], c, o)["step_s"] * 1e3
          for b in (16, *batches)]
    ms = [m * k for m, k in zip(ms, noise, strict=False)]
    doc["rows"][0]["step_ms_p50"] = ms[0]
    doc["cost_model"] = {"compute_ms_by_batch": {str(b): m for b, m in zip((16, *batches), ms, strict=True)}}
    return doc


def calibrate(tmp_path, doc, *flags) -> tuple[int, dict | None]:
    out = folder(tmp_path, doc)
    code = cli.main(["plan", "--calibrate", str(out), *flags])
    path = out / "calibration.json"
    return code, json.loads(path.read_text()) if path.exists() else None


@pytest.mark.parametrize("c, o", [(1.7, 0.6), (0.5, 3.0), (40.0, 2.0)])
def test_the_fit_recovers_the_scales_the_planner_made_its_points_with(c, o):
    spec = calibration.shape_of(H100["config"])
    ms = lambda b, cc, oo: calibration.step(  # noqa: E731
        spec, calibration.compare_training(H100["config"], b), GPUS["h100"], cc, oo)["step_s"] * 1e3
    for batches in ((1, 4, 16, 64), (2, 32)):  # least squares, and two points exactly
        got_c, got_o, how = calibration.fit([(b, ms(b, c, o)) for b in batches], ms)
        assert (got_c, got_o) == (pytest.approx(c, rel=1e-4), pytest.approx(o, rel=1e-4)), (batches, how)
    one_c, one_o, how = calibration.fit([(16, ms(16, c, o))], ms)
    assert one_c == one_o and "one common factor" in how
    assert ms(16, one_c, one_o) == pytest.approx(ms(16, c, o))


def test_the_h100_run_one_point_held_out_within_15_percent_and_calibrated_within_5(tmp_path, capsys):
    code, cal = calibrate(tmp_path, H100)
    assert code == 0, capsys.readouterr().err
    text = " ".join(capsys.readouterr().out.split())  # the console wraps at its width
    assert cal["gpu"] == "h100" and cal["device"] == "NVIDIA H100 80GB HBM3" and cal["run"].endswith("run0")
    (p,) = cal["points"]  # the run was stopped before the cost model timed single at other batches
    assert p["batch"] == 16 and p["measured_ms"] == pytest.approx(55.59, abs=0.01)
    # held out (validate.ROLES): nothing was fitted on compare's step; 48.4 ms predicted for 55.6 (-13.0%)
    assert abs(p["error"]) < 0.15, p
    assert abs(p["calibrated_error"]) < 0.05
    assert cal["compute"] == cal["overhead"] and "one point" in cal["fit"] and "one point" in text
    assert cal["optimizer"] == "sgd-momentum" and cal["precision"] == "bf16"
    assert cal["model"]["params"] == 163_159_680  # compare's untied GPT-2 small, its head's bias too


def test_three_noisy_points_give_both_scales_and_each_step_within_5_percent(tmp_path):
    code, cal = calibrate(tmp_path, synthetic(1.3, 0.7, (2, 8), noise=(1.02, 0.98, 1.01)))
    assert code == 0
    assert [p["batch"] for p in cal["points"]] == [16, 2, 8] and "least squares" in cal["fit"]
    assert all(abs(p["calibrated_error"]) < 0.05 for p in cal["points"]), cal["points"]
    assert cal["compute"] == pytest.approx(1.3, rel=0.1) and cal["overhead"] == pytest.approx(0.7, rel=0.25)


@pytest.mark.parametrize("momentum", [0.9, 0.0])
def test_the_conversion_to_adam_moves_the_optimizer_part_alone(tmp_path, momentum):
    """bf16 both: the layers' compute stays; the optimizer's bytes go from SGD's (32 with momentum, 12 without)
    to mixed-precision Adam's 30: a little less with momentum, 2.5 times more without. Without, SGD's update
    (0.6 ms) is shorter than its piece's launches (26 kernels, 0.7 ms): Adam's longer one hides some of them."""
    doc = copy.deepcopy(H100)
    doc["config"]["momentum"] = momentum
    code, cal = calibrate(tmp_path, doc)
    assert code == 0
    theirs, ours = cal["converted"]["compare"], cal["converted"]["planner"]
    for part in ("compute", "bubble"):
        assert ours[part] == pytest.approx(theirs[part]), part
    moved = 32 if momentum else 12
    assert ours["optimizer"] == pytest.approx(theirs["optimizer"] * 30 / moved)
    if momentum:
        assert ours["overhead"] == pytest.approx(theirs["overhead"])
        assert ours["step_ms"] < theirs["step_ms"]
    else:
        assert ours["overhead"] < theirs["overhead"] and ours["step_ms"] > theirs["step_ms"]


def test_a_cpu_run_is_calibrated_against_the_kind_named(tmp_path, capsys):
    doc = synthetic(300.0, 300.0, ())
    doc["config"]["devices"] = doc["environment"]["devices"] = "cpu:1"
    doc["config"]["precision"] = "fp32"
    code, cal = calibrate(tmp_path, doc, "--gpu", "h200")
    assert code == 0 and cal["gpu"] == "h200" and cal["device"] == "the CPU"
    assert "how far this CPU is from that GPU's model" in " ".join(capsys.readouterr().out.split())
    assert abs(cal["points"][0]["calibrated_error"]) < 1e-9


def test_the_spec_is_compares_model_parameter_for_parameter():
    for arch, tied, ffn in (("gpt", False, 0), ("gpt", True, 0), ("llama", False, 0), ("llama", False, 96)):
        config = {"workload": "transformer", "arch": arch, "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2,
                  "ffn": ffn, "vocab": 100, "seq_len": 16, "tied": tied}
        model = Transformer(100, 16, 64, 2, 4, arch, 2, ffn, tied)
        assert calibration.shape_of(config).params == sum(p.numel() for p in model.parameters()), (arch, tied, ffn)


def one_line_error(capsys, code: int, *words: str) -> None:
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, cli.main(["plan", "--calibrate", str(empty)]), "results.json: not found")
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "results.json").write_text("{not json")
    one_line_error(capsys, cli.main(["plan", "--calibrate", str(tmp_path / "junk")]), "not a comparison's")
    no_single = copy.deepcopy(H100)
    no_single["rows"] = no_single["rows"][1:]
    one_line_error(capsys, calibrate(tmp_path, no_single)[0], "no finished `single` row")
    for change in ({"workload": "cnn", "preset": "", "arch": ""}, {"preset": "", "arch": ""},
                   {"model": "examples/gpt2.py:gpt2"}):
        doc = copy.deepcopy(H100)
        doc["config"] |= change
        one_line_error(capsys, calibrate(tmp_path, doc)[0], "compare --preset gpt2-small")
    one_line_error(capsys, calibrate(tmp_path, H100, "--gpu", "a100-80gb")[0], "--gpu a100-80gb", "h100")
    fp32 = copy.deepcopy(H100)
    fp32["config"]["precision"] = "fp32"
    one_line_error(capsys, calibrate(tmp_path, fp32)[0], "--precision bf16")
    cpu = copy.deepcopy(H100)
    cpu["config"]["devices"] = cpu["environment"]["devices"] = "cpu:1"
    one_line_error(capsys, calibrate(tmp_path, cpu)[0], "--gpu")


def test_a_calibration_plans_later_runs_with_its_scales_for_its_kind_only(tmp_path, capsys):
    code, cal = calibrate(tmp_path, synthetic(1.5, 0.5, (2, 8)))
    assert code == 0
    capsys.readouterr()
    path = str(tmp_path / "run0" / "calibration.json")
    shape = ["plan", "--arch", "gpt", "--layers", "12", "--hidden", "768", "--heads", "12", "--vocab", "50304",
             "--seq", "1024", "--gpus", "1", "--gpus-per-node", "1", "--tp", "1", "--pp", "1", "--dp", "1",
             "--mbs", "16", "--global-batch", "16", "--json"]
    assert cli.main([*shape, "--calibration", path]) == 0  # the kind comes from the file
    (r,) = json.loads(capsys.readouterr().out)
    efficiency = GPUS["h100"].efficiency.scaled(cal["compute"], cal["overhead"])
    expected = cost.predict(ModelShape(12, 768, 12, 50304, 1024), Layout(mbs=16), Training(16, "bf16", **{
        "attention": "flash", "dropout": False, "dp_overlap": True, "elementwise": 3.5}),
        Cluster(dataclasses.replace(GPUS["h100"], efficiency=efficiency), 1, 1))
    assert r["step_s"] == pytest.approx(expected["step_s"]) and r["calibration"]["gpu"] == "h100"
    assert cli.main([*shape, "--gpu", "h100"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["step_s"] != pytest.approx(r["step_s"], rel=0.05)
    one_line_error(capsys, cli.main([*shape, "--gpu", "b200", "--calibration", path]), "calibrates h100")
    (tmp_path / "bad.json").write_text("[]")
    one_line_error(capsys, cli.main([*shape, "--calibration", str(tmp_path / "bad.json")]), "not a calibration")


def test_the_report_shows_the_same_calibration_from_the_run_itself():
    """One calibration: what costmodel.apply puts in results.json is what `plan --calibrate` reads back."""
    doc = synthetic(1.2, 0.9, (2, 8))
    row = doc["rows"][0]
    rows = [types.SimpleNamespace(strategy="single", variant="", status="ok", step_ms_p50=row["step_ms_p50"],
                                  global_batch=16, twin_blocks=0)]
    measured = {int(b): ms for b, ms in doc["cost_model"]["compute_ms_by_batch"].items()}
    cal = types.SimpleNamespace(measured=lambda: measured)
    mine = costmodel.planner_calibration(rows, cal, RunConfig(**doc["config"]), doc["environment"])
    theirs = calibration.of_comparison(doc["config"], doc["environment"], row, doc["cost_model"]["compute_ms_by_batch"])
    assert {k: v for k, v in mine.items() if k != "note"} == theirs
    lines = notes.cost_lines({"alpha_us": None, "copy_GB_per_s": 1.0, "planner": mine,
                               "projection": {"busbw_GB_per_s": 346, "us_by_gpus": {8: 1.0}}})
    assert lines[-1].startswith("planner (plan --calibrate OUT): single's") and "Adam" in lines[-1]
    cpu = costmodel.planner_calibration(rows, cal, RunConfig(**doc["config"]), {"devices": "cpu:1"})
    assert cpu is None  # no GPU kind to calibrate: the report says nothing


def test_the_published_means_have_not_moved():
    # plan --validate --json at 8f5ece3 (before the optimizer field and the untied head), 2026-11-26
    published = {validate.table1: 0.05415497780578802, validate.table5: 0.009852096173532068,
                 validate.figure1: 6.153496087093109e-05, validate.table2: 0.08733602878214668}
    for table, mean in published.items():
        assert validate.summary(table())["mean"] == pytest.approx(mean, rel=1e-12), table.__name__
    rows = validate.single_h100()  # the fit: launch_s on micro-batches 1 and 4, the rest that run's calibration
    assert all(abs(r["error"]) < 0.02 for r in rows[:2]), rows  # launch_s: fitted on these two
    assert all(abs(r["residual"]) < 0.02 for r in rows), rows
