"""The planner held against the Ultra-Scale Playbook's one-node H100 rows (parallel/plan/data): the scores a
user would judge it by, nanotron's stack as read in its code, every fitted constant fitted again from the rows
it names (python -m parallel.plan.evidence.fit), leave one model out, the roles of the validation sets, and ties.
In-process: nothing trains here."""

import json
import shutil

import pytest

from parallel import cli
from parallel.plan import search, stages
from parallel.plan.evidence import fit, validate
from parallel.plan.evidence import playbook as pb
from parallel.plan.layouts import Layout, Training
from parallel.plan.stacks import STACKS
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def scored():
    return validate.playbook()


@pytest.fixture(scope="module")
def loo():
    return fit.leave_one_model_out(pb.runs()[0])


def test_the_sweep_is_read_as_published_and_its_inconsistent_rows_dropped():
    runs, dropped = pb.runs()
    assert dropped == 2 and len(runs) == 243  # 245 one-node rows; two whose mbs x grad_acc x dp is not 256
    assert sum(r.ran for r in runs) == 67 and {r.gpus for r in runs} == {8}
    r = next(r for r in runs if r.describe() == "8B tp2 dp4 mbs1 z1 sp")
    assert (r.tok_s_gpu, r.mem_gib, r.layout.sequence_parallel) == (7141, 65.2, True)


def test_nanotrons_stages_split_by_cost_as_its_build_model_does():
    """1B at pp 8, by hand: a layer costs 4h^2 + 3Fh = 67.1M, the head Vh = 262.7M; the total over 8 is 167M a
    rank. The running total passes rank r's share on its 3rd, 2nd, 3rd, 2nd, 3rd, 2nd layer; the 7th rank takes
    the last layer and then the head (which passes its share), leaving the loss alone on the 8th."""
    model = pb.MODELS["1B"]
    split = stages.by_cost(model, Layout(pp=8), m=256)
    assert [s.layers for s in split] == [3, 2, 3, 2, 3, 2, 1, 0]
    assert [s.rank for s in split if s.head] == [6] and [s.rank for s in split if s.loss] == [7]
    assert split[0].embedding and [s.held for s in split] == [8, 7, 6, 5, 4, 3, 2, 1]
    even = stages.stages(model, Layout(pp=8), Training(256), 256)  # Megatron's: 2 a rank, the head last
    assert [(s.layers, s.head) for s in even] == [(2, False), (2, True)]


def test_the_issues_goals_on_the_fit_set(scored):
    s = scored["summary"]
    assert s["pick_loss_mean"] <= 0.05 and s["pick_loss_worst"] <= 0.10, scored["cells"]
    assert s["crashed_called_fits"] <= 0.10 and s["ran_called_oom"] <= 0.05, scored["confusion"]
    assert s["median_error_mfu20"] <= 0.10 and s["median_mem_error"] <= 0.10, s
    eighty = next(c for c in scored["cells"] if c["model"] == "80B")
    assert eighty["ran"] == 0 and eighty["says_nothing_fits"]  # 57 layouts, every one crashed


def edge_rows(runs) -> set[str]:
    """Layouts the sweep ran on the edge: run twice, once to the end and once to a crash, or run at under half
    its model's median MFU (8B pp2 dp4 z1: 16.6% beside 41-45%, at 71.5 of 80 GiB)."""
    import statistics

    twice = {r.describe() for r in runs if r.ran} & {r.describe() for r in runs if not r.ran}
    ran = [r for r in runs if r.ran]
    median = {m: statistics.median(r.mfu for r in ran if r.model == m) for m in {r.model for r in ran}}
    return twice | {r.describe() for r in runs if r.ran and r.mfu < median[r.model] / 2}


@pytest.mark.slow  # fits the constants again (4-8 s each)
def test_leave_one_model_out_stays_within_one_and_a_half_times_the_goals(loo):
    """With one exception: 8B's 13 rows make one row 7.7%, over 1.5 x 5%, and the one row called out of memory
    there is the edge row that ran at 37% of its neighbours' speed."""
    assert set(loo) == {"1B", "3B", "8B"}
    runs = pb.runs()[0]
    for model, r in loo.items():
        s = r["score"]
        assert s["pick_loss_mean"] <= 1.5 * 0.05 and s["pick_loss_worst"] <= 1.5 * 0.10, (model, s)
        assert s["crashed_called_fits"] <= 1.5 * 0.10, (model, s)
        assert s["median_error_mfu20"] <= 1.5 * 0.10 and s["median_mem_error"] <= 1.5 * 0.10, (model, s)
        pairs = pb.predict_all([x for x in runs if x.model == model], STACKS["nanotron"] | r["constants"])
        called_oom = {x.describe() for x, p in pairs if x.ran and not p["fits"]}
        assert s["ran_called_oom"] <= 1.5 * 0.05 or called_oom <= edge_rows(runs), (model, called_oom)


def test_the_rows_that_ran_called_out_of_memory_are_the_sweeps_edge_rows(scored):
    runs = pb.runs()[0]
    called_oom = {x["row"] for x in scored["rows"] if x["ran"] and not x["fits"]}
    assert called_oom <= edge_rows(runs), called_oom - edge_rows(runs)


@pytest.mark.slow  # fits the constants again (4-8 s each)
def test_the_planners_tie_is_its_own_error_with_a_model_left_out(loo):
    errors = [r["score"]["median_error"] for r in loo.values()]
    assert sum(errors) / len(errors) == pytest.approx(search.TIE, abs=0.005)


def test_the_scores_can_fail_torchs_stack_on_nanotrons_runs_loses_a_fifth():
    """What the issue measured before this stack: torch's (even stages, its kernels, no fp32 buffers), scored
    the same way, picks 8B's slowest-but-one layout and calls 14% of the crashes fitting."""
    s = pb.score(pb.predict_all(pb.runs()[0], STACKS["torch"]))["summary"]
    assert s["pick_loss_mean"] > 0.15 and s["crashed_called_fits"] > 0.10, s


@pytest.mark.slow  # fits the constants again (4-8 s each)
def test_the_fit_gives_the_constants_in_the_code(capsys):
    """python -m parallel.plan.evidence.fit --check: nanotron's four from the Playbook rows, the H100's launch_s from
    the bare loop, the A100's efficiencies within 0.2 points of Table 5's best."""
    assert fit.main(["--check", "--no-loo"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nanotron"]["fitted"] == {k: STACKS["nanotron"][k] for k in report["nanotron"]["fitted"]}
    assert report["a100"]["in_code_mean_error"] <= report["a100"]["best_mean_error"] + 0.002


@pytest.mark.slow  # fits the constants again (4-8 s each)
def test_validate_says_every_sets_role_in_json(capsys):
    assert cli.main(["plan", "--validate", "--json", "--results", "/nonexistent-parallel-results"]) == 2
    capsys.readouterr()
    assert cli.main(["plan", "--validate", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    roles = {k: v["role"] for k, v in doc.items() if isinstance(v, dict) and "role" in v}
    assert roles == {"playbook_1node": "fit", "narayanan_table1": "held out", "narayanan_table2": "held out",
                     "h100_compare_single": "held out", "korthikanti_table5": "fit", "single_h100": "fit",
                     "korthikanti_figure1": "identity"}
    assert set(doc["playbook_1node"]["leave_one_model_out"]) == {"1B", "3B", "8B"}
    assert all(abs(r["error"]) < 0.15 for r in doc["h100_compare_single"]["rows"])  # held out, bounded


@pytest.mark.slow  # fits the constants again, once a process (`plan --validate` refits leaving each model out)
def test_the_validation_prints_in_100_columns_and_a_bad_comparison_is_one_line(capsys, tmp_path):
    shutil.copy(ROOT / "tests" / "data" / "compare_cpu2.json", tmp_path / "results.json")  # a real compare, cpu:2
    assert cli.main(["plan", "--validate", "--results", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "crossover reproduced" in out and "This machine's comparison" in out and "pipeline_dist" in out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert cli.main(["plan", "--validate", "--results", str(tmp_path / "none")]) == 2  # one line, exit 2
    for bad in ('{"rows": [{"status": "ok", "strategy": "ddp"}]}', '{"rows": [1]}', "{}"):  # no variant, not rows
        (tmp_path / "results.json").write_text(bad)
        code = cli.main(["plan", "--validate", "--results", str(tmp_path)])
        assert code == (0 if "ddp" in bad else 2), bad


def test_a_sweep_file_is_scored_as_held_out_and_bad_ones_are_one_line(tmp_path, capsys):
    path = tmp_path / "sweep.csv"
    lines = pb.DATA.read_text().splitlines()
    path.write_text("\n".join([lines[0], *[x for x in lines[1:] if x.startswith("3B,")]]) + "\n")
    assert cli.main(["plan", "--validate", "--sweep", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)["sweep"]
    assert doc["role"] == "held out (given)" and [c["model"] for c in doc["cells"]] == ["3B"]
    (tmp_path / "bad.csv").write_text("model,gpus\n1B,8\n")
    (tmp_path / "short.csv").write_text(lines[0] + "\n1B,1,8,8,1\n")
    (tmp_path / "zero.csv").write_text(lines[0] + "\n" + lines[1].replace("1B,1,8,1,1,8,", "1B,1,8,1,0,8,") + "\n")
    (tmp_path / "empty.csv").write_text(lines[0] + "\n1B,1,8,8,1,1,0,1,32,256,4096,38.3,0,36.7,ok\n")
    for bad in ("bad", "short", "zero", "empty", "missing"):
        assert cli.main(["plan", "--validate", "--sweep", str(tmp_path / f"{bad}.csv")]) == 2, bad
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "--sweep" in err and "Traceback" not in err, (bad, err)
    assert cli.main(["plan", "--sweep", str(path), "--gpus", "8", "--global-batch", "8", "--preset", "llama3-8b"]) == 2
    assert "--validate" in capsys.readouterr().err
    crashed = tmp_path / "crashed.csv"  # nothing ran: every metric that needs a run says so, nothing raises
    crashed.write_text("\n".join([lines[0], *[x for x in lines[1:] if x.startswith("80B,")]]) + "\n")
    assert cli.main(["plan", "--validate", "--sweep", str(crashed), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)["sweep"]["summary"]
    assert summary["ran"] == 0 and summary["pick_loss_mean"] is None and summary["crashed_called_fits"] == 0


def test_a_cell_the_planner_calls_all_too_big_loses_everything():
    runs = [r for r in pb.runs()[0] if r.model == "1B"]
    pairs = [(r, p | {"fits": False}) for r, p in pb.predict_all(runs)]
    (cell,) = pb.score(pairs)["cells"]
    assert cell["pick"] is None and cell["pick_loss"] == 1.0 and cell["pick_loss_any"] == 1.0


def test_a_cost_split_pipeline_is_its_slowest_rank_m_times_plus_the_others_once():
    """nanotron's 1B at pp 8, 256 micro-batches: the step's pipeline part is sum(T_r) + (m - 1) max(T_r), so
    the bubble is the other ranks' sum, and each rank's time holds its sends; the 7th rank (a layer and the
    head) is the slowest, the 8th (the loss alone) sends the logits' gradient back."""
    from parallel.plan import cost
    from parallel.plan.hardware import cluster

    model, lay, cl = pb.MODELS["1B"], Layout(pp=8), cluster(8, "h100")
    train = Training(256, "bf16", **STACKS["nanotron"])
    lt = cost.layer_time(model, lay, train, cl)
    ranks = stages.by_cost(model, lay, 256)
    pipe = cost.pipeline(model, lay, train, cl, lt, ranks)
    times = []
    for st in ranks:
        head, _ = cost.head_time(model, lay, train, cl, st.head, st.loss)
        times.append(st.layers * (lt.forward + lt.backward) + head)
    assert pipe["layers"] == 1 and pipe["head"] > 0  # the busiest: rank 6
    assert pipe["stage"] == pytest.approx(times[6] + pipe["handoff"])
    logits = 4096 * model.vocab * 2  # bf16, tp 1: the hand-off between the head's rank and the loss's
    assert pipe["handoff"] > 2 * cl.collective_s("send", logits, 2, 2)  # its sends, and what it receives
    assert pipe["bubble"] > sum(times) - times[6] and pipe["handoff_in_stage"]


def test_zero_1s_gather_after_the_step_is_never_hidden_and_the_usable_memory_is_the_stacks():
    from parallel.plan import cost
    from parallel.plan.hardware import cluster
    from parallel.plan.memory import usable_gib

    model, cl = pb.MODELS["1B"], cluster(8, "h100")
    train = Training(256, "bf16", **STACKS["torch"])  # overlaps data parallelism under backward
    z0, z1 = (cost.predict(model, Layout(dp=8, zero_stage=z), train, cl) for z in (0, 1))
    gather = cl.collective_s("all_gather", model.params * 2, 8)
    assert z0["exposed_comm_s"]["dp"] == 0.0 and z1["exposed_comm_s"]["dp"] >= gather
    assert usable_gib(80, train) == pytest.approx(76.0)
    assert usable_gib(80, Training(1, memory_fixed_gib=2, memory_usable=0.5)) == pytest.approx(39.0)


def test_layouts_within_the_planners_error_are_not_told_apart(capsys):
    args = ["plan", "--preset", "llama3-8b", "--gpus", "8", "--gpu", "h100", "--global-batch", "256", "--seq",
            "4096", "--stack", "nanotron", "--cp", "1"]
    assert cli.main([*args, "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)
    close = [r for r in ranked[1:] if r["step_s"] <= (1 + search.TIE) * ranked[0]["step_s"]]
    assert close and all(r["not_told_apart_from_first"] for r in close)
    assert not any(r["not_told_apart_from_first"] for r in ranked if r not in close)
    assert cli.main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "not told apart from it" in text and "predicted fastest" in text
