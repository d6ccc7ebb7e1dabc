"""The CUDA paths' logic, on a machine with no GPU: each finding of the GPU-readiness review (#13) as a
test that failed on the code before the fix. The `strict_cuda` fixture replaces parallel.world.devices.CUDA
with a stand-in that enforces CUDA's rules and logs every call (tests/strict_cuda.py); `on_cpu` lets
whole strategies run with cuda:i device objects, their tensors on the CPU."""

import dataclasses
import json
import sys
import types

import pytest
import torch
from torch import nn

from parallel import cli, strategies
from parallel.config import ConfigError, RunConfig
from parallel.kit import stages
from parallel.loop import timing
from parallel.loop.timing import StepTimer
from parallel.measure import pipelines, stage_time
from parallel.models.data import SyntheticData
from parallel.models.workloads import WORKLOADS
from parallel.report import costmodel
from parallel.world.dist import Dist, script_devices
from tests.strict_cuda import Clock, on_cpu, synced_before_every_clock

pytestmark = pytest.mark.timeout(120)


def _config(devices: str, **kw) -> RunConfig:
    base = {"workload": "cnn", "batch_size": 32, "steps": 3, "warmup": 1, "devices": devices}
    return RunConfig(**{**base, **kw}).validate()


def _execute(name: str, config: RunConfig, fake, monkeypatch):
    """worker.execute with the loop's clock logged into the stand-in's log."""
    from parallel import worker
    from parallel.loop import train

    monkeypatch.setattr(train, "StepTimer", lambda sync: train_timer(sync, fake))
    with on_cpu(fake):
        return worker.execute(strategies.get(name), config, Dist(device=config.spec.device(0)))


def train_timer(sync, fake):
    return StepTimer(sync, clock=Clock(fake))  # the class itself, bound at import: tests patch the name


# 1. CUDA initialised before any memory statistic; 4. every device in peak memory


def test_memory_statistics_come_after_cuda_is_initialised(strict_cuda, monkeypatch):
    row, _ = _execute("single", _config("cuda:0"), strict_cuda, monkeypatch)
    kinds = [e[0] for e in strict_cuda.log]
    assert kinds.index("init") < kinds.index("reset")  # before the fix: reset first, and the allocator refuses
    assert row.peak_mem_kind == "cuda_max_allocated" and row.peak_mem_bytes == 1000


def test_an_in_process_strategy_resets_and_reads_peak_memory_of_every_device_it_drives(strict_cuda, monkeypatch):
    row, _ = _execute("manual_dp", _config("cuda:0,1"), strict_cuda, monkeypatch)
    assert {e[1] for e in strict_cuda.entries("reset")} == {0, 1}
    assert {e[1] for e in strict_cuda.entries("peak")} == {0, 1}
    assert row.details["cuda_max_allocated_per_device"] == [1000, 2000]
    assert row.peak_mem_bytes == 2000  # the largest, not device 0's alone


def test_the_loop_synchronizes_every_device_before_each_clock_read(strict_cuda, monkeypatch):
    _execute("model_parallel", _config("cuda:0,1", options={"balance": "params"}), strict_cuda, monkeypatch)
    assert strict_cuda.entries("clock")
    assert synced_before_every_clock(strict_cuda.log, {0, 1})


# 2. the stage split times each layer on the device it will run on, synchronized, and the real transfer


def test_layers_are_timed_on_the_stage_device_not_where_the_model_was_built():
    # The meta device stands in for a GPU: a layer left on the CPU refuses a meta input, as a CPU layer
    # refuses a CUDA one ("Tensor on device cpu is not on the expected device meta!").
    model = WORKLOADS["mlp"].build_model(0)
    sample = SyntheticData(WORKLOADS["mlp"], 0, 8).batch(0)[0]
    meta = torch.device("meta")
    costs, moves = stages.measure_layers(stages.layers_of(model), sample, [meta, meta], reps=1)
    assert len(costs) == len(moves) == len(stages.layers_of(model))
    assert all(p.device.type == "cpu" for p in model.parameters())  # the model itself stays where it was


def test_layer_timing_synchronizes_and_copies_to_the_next_device(strict_cuda, monkeypatch):
    monkeypatch.setattr(timing, "StepTimer", lambda sync: train_timer(sync, strict_cuda))
    model = WORKLOADS["cnn"].build_model(0)
    sample = SyntheticData(WORKLOADS["cnn"], 0, 8).batch(0)[0]
    with on_cpu(strict_cuda):
        stages.measure_layers(stages.layers_of(model), sample, [torch.device("cuda", 0), torch.device("cuda", 1)],
                              reps=2)
    layers = len(stages.layers_of(model))
    assert len(strict_cuda.entries("clock")) == 2 * 3 * 2 * layers  # (fwd+bwd, copy) x 3 runs x 2 reads
    assert synced_before_every_clock(strict_cuda.log, {0, 1})
    assert ("to", 1) in strict_cuda.log  # the activation really went to the next stage's device


# 3. under torchrun the world is torchrun's; `auto` is one device per local process


def test_auto_devices_for_a_torchrun_strategy_follow_the_local_processes(strict_cuda):
    assert script_devices("auto", "torchrun", {}) == "cuda:0"  # python scripts/ddp.py: a world of one
    assert script_devices("auto", "torchrun", {"LOCAL_WORLD_SIZE": "2"}) == "cuda:0,1"
    assert script_devices("auto", "inprocess", {}) == "auto"  # manual_dp drives every device itself
    with pytest.raises(ConfigError, match="3 processes on this node but only 2 CUDA"):
        script_devices("auto", "torchrun", {"LOCAL_WORLD_SIZE": "3"})


def test_auto_devices_without_gpus(no_cuda):
    assert script_devices("auto", "torchrun", {}) == "cpu:1"
    assert script_devices("auto", "torchrun", {"LOCAL_WORLD_SIZE": "4"}) == "cpu:4"
    assert script_devices("cpu:3", "torchrun", {"LOCAL_WORLD_SIZE": "2"}) == "cpu:3"


def test_a_torchrun_script_run_alone_is_a_world_of_one(tmp_path, monkeypatch, capsys, no_cuda):
    # `python scripts/ddp.py --steps 3`: world size 1, one device, nothing to communicate, predicted or measured.
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    assert cli.script_main("ddp", ["--steps", "3", "--batch-size", "32", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert (row["world_size"], row["devices"]) == (1, "cpu:1")
    assert row["comm_bytes_predicted"] == 0 and row["comm_bytes_per_step"] == 0
    assert "1 serial" in capsys.readouterr().out  # one device: its machinery runs, nothing in parallel


# 5. nn.DataParallel is given its devices, never None


def test_data_parallel_on_cpu_devices_leaves_the_gpus_alone(strict_cuda, monkeypatch):
    # torch's own view of a GPU machine: nn.DataParallel(device_ids=None) would take both GPUs.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    config = _config("cpu:2")
    s = strategies.get("data_parallel")
    t = s.setup(WORKLOADS["cnn"].build_model(0), lambda p: torch.optim.SGD(p, lr=0.1), WORKLOADS["cnn"].loss,
                Dist(), config)
    x, y = SyntheticData(WORKLOADS["cnn"], 0, 8).batch(0)
    assert s.train_step(t, (x, y), None).device.type == "cpu"
    assert not getattr(t.model, "device_ids", [])


def test_data_parallel_on_gpus_names_them(strict_cuda, monkeypatch):
    from parallel.strategies.data import data_parallel

    made = {}

    class Recorder(nn.Module):
        def __init__(self, module, device_ids=None, output_device=None):
            super().__init__()
            self.module = module
            made.update(device_ids=device_ids, output_device=output_device)

    monkeypatch.setattr(data_parallel.nn, "DataParallel", Recorder)
    with on_cpu(strict_cuda):
        data_parallel.setup(WORKLOADS["cnn"].build_model(0), lambda p: torch.optim.SGD(p, lr=0.1),
                            WORKLOADS["cnn"].loss, Dist(), _config("cuda:1,0"))
    assert made == {"device_ids": [1, 0], "output_device": 1}


# 6. the parent process opens no CUDA context


def test_the_environment_record_reads_gpus_without_a_cuda_context(strict_cuda, monkeypatch):
    from parallel.world import devicespec, machine

    class Memory:
        total, free = 80 << 30, 79 << 30

    nvml = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMemoryInfo=lambda h: Memory(),
        nvmlDeviceGetCudaComputeCapability=lambda h: (9, 0), nvmlDeviceGetName=lambda h: b"NVIDIA H100")
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = machine.environment(devicespec.parse_devices("cuda:0,1"))
    assert [g["name"] for g in env["gpus"]] == ["NVIDIA H100"] * 2 and env["gpus"][1]["free_bytes"] == 79 << 30
    assert strict_cuda.log == []  # no init, no memory query, no synchronize: no context in the parent


def test_without_nvml_a_short_lived_child_asks_cuda(strict_cuda, monkeypatch):
    from parallel.world import machine

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    asked = []
    monkeypatch.setattr(machine, "_child_cuda_info", lambda: asked.append(1) or [])
    machine.cuda_info()
    assert asked == [1] and strict_cuda.log == []


# 7. Hogwild refuses CUDA in validate, for every entry point


def test_hogwild_on_gpus_is_refused_by_every_entry_point(strict_cuda, capsys):
    with pytest.raises(ConfigError, match="hogwild cannot run on cuda:0,1: Hogwild here shares CPU memory"):
        strategies.get("hogwild").validate(_config("cuda:0,1"))
    assert cli.script_main("hogwild", ["--devices", "cuda:0,1"]) == 2
    assert "Hogwild here shares CPU memory" in capsys.readouterr().err


# 8. the cost model calibrates the real copy and models overlap where the backend overlaps


def test_copy_bandwidth_is_calibrated_between_devices(strict_cuda, monkeypatch):
    monkeypatch.setattr(timing, "StepTimer", lambda sync: train_timer(sync, strict_cuda))
    with on_cpu(strict_cuda):
        assert costmodel.Calibration(_config("cuda:0,1")).copy_bytes_per_s > 0
    assert ("to", 1) in strict_cuda.log
    assert synced_before_every_clock(strict_cuda.log, {0, 1})


def _cal(overlaps: bool):
    return types.SimpleNamespace(compute_ms=lambda b: 12.0, grad_bytes=64 << 20, overlaps=overlaps,
                                 allreduce_ms=lambda n, w: 6.0 * n / (64 << 20) + 0.1)


def test_ddp_prediction_hides_the_all_reduce_behind_backward_only_where_it_overlaps():
    ddp = strategies.get("ddp")
    config = _config("cpu:2")
    on_cpu_ms = ddp.predict_step_ms(_cal(overlaps=False), config, None)
    on_nccl_ms = ddp.predict_step_ms(_cal(overlaps=True), config, None)
    assert on_cpu_ms == pytest.approx(12.0 + 6.1)  # gloo: compute + the whole all-reduce
    # nccl: backward (2/3 of 12 ms = 8 ms) hides the 6.1 ms all-reduce but for its last 1 MiB bucket
    assert on_nccl_ms == pytest.approx(12.0 + 6.0 / 64 + 0.1)


# 9. no synchronize inside the step: events for phases and busy intervals


def test_manual_dp_times_its_phases_with_events_not_synchronizes(strict_cuda, monkeypatch):
    config = _config("cuda:0,1")
    row, _ = _execute("manual_dp", config, strict_cuda, monkeypatch)
    steps = config.warmup + config.steps
    # Per step: the loop's two synchronized clock reads and the events' resolution at the step's end, on
    # each device. Before: two more per phase per device (six phases).
    assert len(strict_cuda.entries("sync")) <= steps * 3 * 2
    assert strict_cuda.entries("record")
    assert {"scatter_ms", "replicate_ms", "parallel_apply_ms", "gather_ms", "backward_ms",
            "optimizer_ms"} <= row.details["sharded"]["step_phases_ms"].keys()


def test_pipeline_busy_intervals_are_events_resolved_at_the_step_end(strict_cuda):
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    busy = stage_time.Busy(devs)
    busy.start_step()
    with busy(0, "F0"):
        sum(range(20000))
    with busy(1, "F0"):
        sum(range(20000))
    assert strict_cuda.entries("sync") == []  # nothing inside the step waits for a device
    busy.end_step()
    assert 0 < busy.bubbles[0] < 1 and all(ms > 0 for ms in busy.busy_ms[0])


def test_cpu_runs_are_unchanged_by_the_clock(small):
    from parallel import worker

    config = dataclasses.replace(small(), options={"microbatches": 4})
    row, _ = worker.execute(strategies.get("pipeline"), config, Dist())
    assert 0 <= row.measured.bubble_measured < 1 and len(pipelines.result(row).busy_ms) == 2


def test_devices_command_initialises_cuda_before_reading_memory(strict_cuda, monkeypatch, capsys):
    from parallel.world import machine

    monkeypatch.setattr(machine, "_nvml_info", lambda: None)
    monkeypatch.setattr(machine, "_child_cuda_info", lambda: [])
    with on_cpu(strict_cuda):
        assert cli.main(["devices"]) == 0
    kinds = [e[0] for e in strict_cuda.log]
    assert kinds.index("init") < kinds.index("memory") and "empty_cache" in kinds
    assert "after torch.cuda.empty_cache()" in capsys.readouterr().out


# 10. NCCL's bootstrap stays on loopback in the harness's single-node launches


def test_harness_launches_keep_nccl_on_loopback_unless_told_otherwise(monkeypatch):
    from parallel.launch import child as launch

    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert launch.torchrun_env() == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_SOCKET_IFNAME": "lo"}
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    assert launch.torchrun_env()["NCCL_SOCKET_IFNAME"] == "ib0"


def test_other_processes_on_the_runs_gpus_are_found_through_nvml_and_ours_left_out(monkeypatch):
    # NVML stand-in: GPU 0 runs a stranger (pid 999999) and this process; GPU 1 nobody
    import os
    import sys
    import types

    from parallel.world import devices, load, machine

    procs = {0: [999999, os.getpid()], 1: []}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [types.SimpleNamespace(pid=p) for p in procs[h]])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert machine.gpu_process_ids([0, 1]) == {999999, os.getpid()}
    assert load.ForeignLoad([0, 1]).stop()[1] == [999999]
    assert load.ForeignLoad([1]).stop()[1] == []


def test_gpus_that_this_torch_cannot_use_are_named_not_hidden(monkeypatch):
    # Before: with a driver too old for the wheel (or a CPU-only torch), `auto` quietly became cpu:2 and
    # preflight said "no CUDA device here". Now the reason is stated, in the report and in preflight.
    from parallel import preflight
    from parallel.world import devices, devicespec, machine

    monkeypatch.setattr(devices, "gpu_count", lambda: 0)
    monkeypatch.setattr(machine, "_nvidia_present", lambda: (8, "12.2"))
    monkeypatch.setattr(machine.torch.version, "cuda", "13.0")
    why = machine.unusable_gpus()
    assert why.startswith("8 NVIDIA GPU(s) here, but torch") and "built for CUDA 13.0" in why and "12.2" in why
    assert devicespec.parse_devices("auto").kind == "cpu"  # still runs, on the CPU ...
    assert machine.environment(devicespec.parse_devices("auto"))["gpus_unusable"] == why  # ... and says why
    monkeypatch.setattr(preflight, "gpu_count", lambda: 0)
    monkeypatch.setattr(preflight, "unusable_gpus", machine.unusable_gpus)
    checks = preflight.cuda_only(_config("cpu:2"))
    assert checks and all(c.status == "not run" and c.detail == why for c in checks)
    with pytest.raises(ConfigError, match="8 NVIDIA GPU"):
        devicespec.parse_devices("cuda:0")
    monkeypatch.setattr(machine.torch.version, "cuda", None)
    assert "CPU-only build" in machine.unusable_gpus()
    monkeypatch.setattr(machine, "_nvidia_present", lambda: (0, ""))
    assert machine.unusable_gpus() is None  # no GPU at all: nothing to say


def test_a_memory_cap_holds_the_allocator_of_every_gpu_a_process_drives(strict_cuda, monkeypatch):
    _execute("manual_dp", _config("cuda:0,1", memory_cap_mb=512.0), strict_cuda, monkeypatch)
    assert strict_cuda.entries("cap") == [("cap", 0, 512 / (80 * 1024)), ("cap", 1, 512 / (80 * 1024))]
    strict_cuda.log.clear()
    _execute("single", _config("cuda:0"), strict_cuda, monkeypatch)
    assert strict_cuda.entries("cap") == []  # no cap asked: the allocator left alone


# #45: peak reserved beside peak allocated; --memory-snapshot's allocator history for one untimed step


def test_reserved_memory_is_read_and_one_warm_up_step_is_snapshotted(strict_cuda, monkeypatch, tmp_path):
    config = _config("cuda:0", memory_snapshot="single", out=str(tmp_path), warmup=2)
    row, _ = _execute("single", config, strict_cuda, monkeypatch)
    assert row.details["cuda_max_reserved"] == 2000 and row.peak_mem_bytes == 1000
    history = strict_cuda.entries("history")
    assert history == [("history", 0, True), ("history", 0, False)]  # on and off once: one step
    at = [i for i, e in enumerate(strict_cuda.log) if e[0] in ("history", "clock", "snapshot")]
    kinds = [strict_cuda.log[i][0] for i in at]
    # recorded over the second (last) warm-up step, its two clock reads inside, dumped before the next step
    assert kinds[:7] == ["clock", "clock", "history", "clock", "clock", "snapshot", "history"]
    assert kinds[7:] == ["clock", "clock"] * 3  # the three timed steps, not recorded
    assert (tmp_path / "memory" / "single-rank0.pickle").exists()


@pytest.mark.parametrize("name", ["manual_tp", "tensor_parallel", "fsdp_tp"])
def test_the_tensor_parallel_prediction_prices_megatrons_all_reduces_on_a_tp_groups_share(name):
    """The prediction runs through the Run its strategy is handed (a transformer, dp x tp on 4 ranks): the
    bytes of one tp group's share of the batch, all-reduced over tp, on top of its compute over tp."""
    from parallel.config import RunConfig
    from parallel.measure.layers import payloads

    strategy = strategies.get(name)
    config = RunConfig(devices="cpu:4", workload="transformer", batch_size=16, options={"tp": 2}).validate()
    run = strategy.run(config)
    tp, dp = (2, 2) if name == "fsdp_tp" else (4, 1)
    ms = strategy.predict_step_ms(_cal(overlaps=False), config, None)
    megatron = sum(6.0 * p / (64 << 20) + 0.1 for p in payloads(run.meta_model, run, 16 // dp))
    fsdp = 2 * (6.0 * (64 << 20) / tp / (64 << 20) + 0.1) if dp > 1 else 0.0  # gloo: an all-reduce, 2 gathers
    assert ms == pytest.approx(12.0 / tp + megatron + fsdp)
