"""Planning on every machine a user has (#28): 1 to 8 devices, one GPU shared by several ranks, strategies
that cannot run left out with their reason, defaults fitted to the device count. In-process and fast: the
plan is made, nothing is trained (the end-to-end runs are in the slow tier at the end)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from parallel import cli, cliargs, strategies
from parallel.compare import select_runs
from parallel.config import ConfigError, RunConfig
from parallel.report import scaling
from parallel.world.devicespec import DeviceSpec, parse_devices
from parallel.world.dist import Dist, script_devices
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(120)


def planned(devices: str, **kw):
    config = RunConfig(devices=devices, batch_auto=True, **kw).validate()
    chosen, skipped = select_runs(config, ["all"])
    return config, {s.name: cfg for s, _, cfg in chosen}, skipped


@pytest.mark.parametrize("n", range(1, 9))
def test_every_device_count_from_1_to_8_runs_what_can_run_and_names_the_rest(n):
    # Before: N = 1 (pipeline_dist), 3, 5, 6, 7 (a batch of 512 that N does not divide) and 8 (1f1b's
    # micro-batches) each refused the whole comparison.
    config, runs, skipped = planned(f"cpu:{n}")
    assert config.batch_size % n == 0 and abs(config.batch_size - 512) < n  # the default, rounded to the world
    assert list(runs)[0] == "single" and set(runs) | set(skipped) == set(strategies.NAMES)
    assert all(why.strip() for why in skipped.values())
    assert {"ddp", "manual_ddp", "zero", "zero_optimizer", "fsdp", "manual_dp", "hogwild", "model_parallel",
            "pipeline"} <= set(runs)  # data parallel at every count: the batch divides
    if 2 <= n <= 5:
        m = runs["pipeline_dist"].options["microbatches"]
        assert m >= n and config.batch_size % m == 0  # 1f1b's need, whole micro-batches
    elif n == 1:
        assert skipped["pipeline_dist"].startswith("needs 2 devices or more")
    else:  # the CNN has 5 layers with parameters: a sixth stage would have nothing to train
        assert "only 5 of the cnn's layers have parameters" in skipped["pipeline_dist"]
    assert ("fsdp_pp" in runs) == (n in (4, 6, 8))  # pp 2 x dp >= 2
    assert "tensor_parallel" in skipped and "no tensor-parallel plan" in skipped["tensor_parallel"]  # the CNN


@pytest.mark.parametrize("n", [3, 5, 8])
def test_preflights_batch_is_a_multiple_of_the_world(n, tmp_path):
    from parallel import preflight

    p = cli.build_parser()
    config = preflight._config(p.parse_args(["preflight", "--devices", f"cpu:{n}", "--out", str(tmp_path)]))
    assert config.batch_size % n == 0 and abs(config.batch_size - 64) < n
    select_runs(config, ["all"])  # every strategy that can run at n fits its batch


def test_the_interleaved_schedules_get_whole_rounds_of_micro_batches():
    from parallel.strategies.model import pipeline_dist

    config = RunConfig(devices="cpu:3", batch_auto=True, options={"schedule": "interleaved1f1b"}).validate()
    run = strategies.get("pipeline_dist").run  # the Run a strategy is handed: its options typed
    assert pipeline_dist.fit_microbatches(run(config), 3, 513) == {"microbatches": 9}  # 6 does not divide 513
    assert pipeline_dist.fit_microbatches(run(dataclasses.replace(config, options={})), 3, 513) == {"microbatches": 9}
    assert pipeline_dist.fit_microbatches(run(dataclasses.replace(config, options={})), 2, 512) == {"microbatches": 4}
    _, runs, _ = planned("cpu:2", workload="mlp", options={"schedule": "interleaved1f1b"})
    assert runs["pipeline_dist"].options["microbatches"] == 4  # whole rounds of 2


def test_a_users_own_values_are_kept_and_checked():
    _, runs, skipped = planned("cpu:4", options={"microbatches": 2})  # 2 < 4 stages: 1f1b refuses it
    assert "pipeline_dist" not in runs and "at least as many micro-batches as stages: 2 < 4" in skipped["pipeline_dist"]
    assert runs["pipeline"].options["microbatches"] == 2
    config = RunConfig(devices="cpu:3", batch_size=512).validate()
    assert config.batch_size == 512  # given, so not rounded: the data-parallel ones say why they cannot
    _, skipped = select_runs(config, ["all"])
    assert skipped["ddp"] == "global batch 512 is not divisible by world size 3 x accum 1 = 3"


def test_a_strategy_named_explicitly_that_cannot_run_is_refused(refused):
    refused(["compare", "--strategies", "pipeline_dist", "--devices", "cpu:1"],
            "pipeline_dist cannot run on cpu:1: needs 2 devices or more")
    refused(["compare", "--strategies", "ddp", "--devices", "cpu:3", "--batch-size", "512"],
            "global batch 512 is not divisible by world size 3")


def test_a_scaling_sweep_takes_one_batch_every_count_divides():
    config = RunConfig(devices="cpu:4", batch_auto=True).validate()
    points = scaling.points(config, [1, 2, 3, 4])
    strong = [cfg for mode, _, cfg in points if mode == "strong"]
    assert {c.batch_size for c in strong} == {516}  # the multiple of 12 nearest 512
    for _, n, cfg in points:
        chosen, _ = select_runs(cfg, ["ddp"], strict=False)
        assert [s.name for s, _, _ in chosen] == ["single", "ddp"], n


def test_a_scaling_sweep_stays_on_the_users_gpus(strict_cuda):
    strict_cuda.count = 8
    config = RunConfig(devices="cuda:4,5,6,7").validate()
    assert [cfg.devices for mode, _, cfg in scaling.points(config, [1, 2, 4]) if mode == "strong"] == \
        ["cuda:4", "cuda:4,5", "cuda:4,5,6,7"]  # before: cuda:0, cuda:0,1, cuda:0,1,2,3
    with pytest.raises(ConfigError, match="8 devices asked of cuda:4,5,6,7"):
        scaling.points(config, [8])


# ---- one GPU shared by several ranks (cuda:IxK)


def test_one_gpu_is_shared_by_ranks_over_gloo(strict_cuda):
    strict_cuda.count = 1
    spec = parse_devices("auto")  # a one-GPU machine: two ranks share it
    assert (str(spec), spec.shared, spec.backend, spec.kind_label, spec.count) == ("cuda:0x2", True, "gloo",
                                                                                 "shared", 2)
    assert spec.device(1) == torch.device("cuda", 0)
    assert str(parse_devices("cuda:0x4")) == "cuda:0x4" and parse_devices("cuda:0x1") == DeviceSpec("cuda", (0,))
    assert Dist.from_env(spec, {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}).backend \
        == "gloo"  # nccl refuses two ranks on one GPU
    assert script_devices("auto", "torchrun", {"LOCAL_WORLD_SIZE": "2"}) == "cuda:0x2"
    with pytest.raises(ConfigError, match="to share one GPU between ranks, cuda:0x2"):
        parse_devices("cuda:0,0")
    strict_cuda.count = 2
    assert str(parse_devices("auto")) == "cuda:0,1" and parse_devices("auto").backend == "nccl"


def test_a_shared_gpu_runs_what_gloo_can_carry_and_names_the_rest(strict_cuda):
    config, runs, skipped = planned("cuda:1x4", workload="transformer")
    assert {"ddp", "fsdp", "zero", "manual_tp", "manual_dp", "data_parallel", "pipeline"} <= set(runs)
    assert "cannot send CUDA tensors point to point" in skipped["pipeline_dist"]  # measured: send/recv aborts
    assert "cannot send CUDA tensors point to point" in skipped["fsdp_pp"]
    assert "crash on gloo with CUDA tensors" in skipped["tensor_parallel"] and "crash" in skipped["fsdp_tp"]
    assert "CUDA is not supported" in skipped["hogwild"]
    kinds = {name: strategies.get(name).kind(cfg) for name, cfg in runs.items()}
    assert kinds["single"] == "real" and kinds["ddp"] == "shared" and kinds["data_parallel"] == "shared"


def test_one_device_rows_say_nothing_runs_in_parallel():
    config = RunConfig(devices="cpu:1").validate()
    kinds = {n: strategies.get(n).kind(config) for n in ("single", "manual_dp", "data_parallel", "model_parallel",
                                                         "pipeline", "ddp")}
    assert kinds == {"single": "virtual", "manual_dp": "serial", "data_parallel": "pass-through",
                     "model_parallel": "serial", "pipeline": "serial", "ddp": "serial"}


def test_runs_on_gpus_have_tf32_off_and_say_so(strict_cuda, monkeypatch):
    from parallel.world import machine
    from tests.test_gpu_paths import _config, _execute

    _execute("single", _config("cuda:0"), strict_cuda, monkeypatch)
    log = [e[0] for e in strict_cuda.log]
    assert "exact_fp32" in log and log.index("exact_fp32") < log.index("to")  # before the model is on the GPU
    assert machine.environment(parse_devices("cuda:0"))["tf32"].startswith("off")
    assert "tf32" not in machine.environment(parse_devices("cpu:2"))


def test_cudas_fp32_is_exact_after_exact_fp32():
    from parallel.world.devices import Cuda

    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, matmul.fp32_precision)
    try:
        Cuda().exact_fp32()  # settings only: no GPU needed to set them
        assert (cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, matmul.fp32_precision) == ("ieee",) * 3
    finally:
        cudnn.conv.fp32_precision, cudnn.rnn.fp32_precision, matmul.fp32_precision = before


def test_devices_lists_what_compare_would_run(capsys):
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out
    assert "what `compare` runs with --devices auto" in out and "skipped" in out


# ---- a mistake under torchrun is said once


def test_a_refusal_under_torchrun_is_printed_by_rank_0_and_given_to_torchrun(tmp_path, capsys):
    for rank in ("0", "1"):
        error_file = tmp_path / f"error-{rank}.json"
        env = {"RANK": rank, "TORCHELASTIC_ERROR_FILE": str(error_file)}
        assert cliargs.refuse("error: global batch 512 ...", env) == 2
        message = json.loads(error_file.read_text())["message"]
        assert message["message"] == "error: global batch 512 ..." and "py_callstack" not in message["extraInfo"]
    assert capsys.readouterr().err.splitlines() == ["error: global batch 512 ..."]  # once, by rank 0


@pytest.mark.slow
def test_torchrun_with_a_batch_that_does_not_divide_says_why_once(tmp_path):
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3", "--standalone",
                        str(ROOT / "scripts" / "ddp.py"), "--batch-size", "512", "--steps", "1"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=110, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = p.stdout + p.stderr
    line = "error: global batch 512 is not divisible by world size 3 x accum 1 = 3"
    assert p.returncode != 0 and out.count(f"\n{line}\n") + out.startswith(f"{line}\n") == 1, out
    assert f"traceback : {line}" in out  # torchrun's root cause names it
    # No traceback through the project's code (torchrun prints its own, and the interpreter's path, which
    # holds the checkout's folder: often named parallel/).
    assert f'File "{ROOT / "parallel"}' not in out and f'File "{ROOT / "scripts"}' not in out, out


def test_a_sweep_leaves_a_named_strategy_out_of_a_point_it_cannot_run():
    # A named strategy at a count whose share does not divide its batch sits that point out (the sweep's
    # strict=False), as one without enough devices always did; a plain comparison still refuses it.
    config = RunConfig(devices="cpu:3", batch_size=32).validate()
    chosen, skipped = select_runs(config, ["ddp"], strict=False)
    assert [s.name for s, _, _ in chosen] == ["single"] and "not divisible by world size 3" in skipped["ddp"]
    with pytest.raises(ConfigError, match="not divisible by world size 3"):
        select_runs(config, ["ddp"])


def test_devices_runs_and_skips_what_compare_would(capsys):
    """`devices` and `compare` agree (#29): the same config (compare's own parser, no arguments), the same
    planner, and a skipped strategy worded as compare words it in full ("NAME skipped: WHY")."""
    assert cli.main(["devices"]) == 0
    out = capsys.readouterr().out.splitlines()
    config = cliargs.config_from_args(cli.build_parser().parse_args(["compare"]), default_out=False)
    chosen, skipped = select_runs(config, ["all"])
    said = {k: v for k, _, v in (ln.removeprefix("- ").partition(": ") for ln in out if ln.startswith("- compare "))}
    assert said["compare runs"].split(", ") == list(dict.fromkeys(s.name for s, _, _ in chosen))
    assert said["compare skips"] == (", ".join(skipped) or "nothing")
    assert all(f"- {name} skipped: {why}" in out for name, why in skipped.items())
    assert skipped, "on this machine's defaults something is skipped (tensor parallelism has no cnn plan)"


def test_a_cut_into_more_stages_than_layers_is_skipped_at_planning_with_its_reason():
    # The transformer has 4 layers to cut (embedding, 2 blocks, head): over 5 devices every strategy that
    # cuts it into a stage a device is left out under `all`, with the numbers, and refused when named;
    # model_parallel and pipeline failed in their first step before (#44).
    config = RunConfig(workload="transformer", devices="cpu:5", batch_size=10).validate()
    chosen, skipped = select_runs(config, ["all"])
    for name in ("model_parallel", "pipeline"):
        assert skipped[name] == "5 stages (one a device), but the transformer has 4 layers to split", skipped
    assert "pipeline_dist" in skipped and {"single", "ddp"} <= {s.name for s, _, _ in chosen}
    with pytest.raises(ConfigError, match="5 stages .one a device., but the transformer has 4 layers"):
        select_runs(config, ["pipeline"])
    four = RunConfig(workload="transformer", devices="cpu:4", batch_size=8).validate()
    select_runs(four, ["model_parallel", "pipeline"])
