"""The planner's memory beside each row (report/memcheck.py, plan/local.need), on a real H100 run's rows
(tests/data: GPT-2 small in bf16 on cuda:0x2, 2026-11-26) and on layouts of every strategy family."""

import dataclasses
import json
from pathlib import Path

import pytest
from rich.console import Console

from parallel.config import RunConfig
from parallel.loop.results import Row
from parallel.models.usermodel import shape_model
from parallel.plan import local
from parallel.report import memcheck

H100 = Path(__file__).parent / "data" / "h100_gpt2_small_results.json"


@pytest.fixture
def one_gpu(monkeypatch):
    from parallel.world import devices
    from tests.strict_cuda import StrictCuda

    monkeypatch.setattr(devices, "CUDA", StrictCuda(count=1))  # the H100 run's cuda:0x2 parses here


def test_the_planner_counts_an_h100_runs_model_state_exactly_and_its_peak_within_a_fifth(one_gpu):
    saved = json.loads(H100.read_text())
    config = RunConfig.from_json(json.dumps(saved["config"]))
    rows = [Row.from_dict(r) for r in saved["rows"]]
    from parallel import strategies

    memcheck.attach(rows, [(strategies.get(r.strategy), "", config) for r in rows], config)
    by = {r.strategy: r for r in rows}
    for name in ("single", "manual_ddp", "ddp"):  # one full replica a process (data_parallel's two share a GPU)
        p, r = by[name].details["planner_memory"], by[name]
        assert p["model_state"] == max(r.details["model_state_bytes_per_device"]), name
        # what the planner leaves out (autocast's bf16 weights, buckets, the allocator's blocks): 15-25%
        assert 0.75 < p["total"] / r.peak_mem_bytes < 0.9, (name, p["total"], r.peak_mem_bytes)
    console = Console(width=100, record=True, color_system=None)  # the terminal report's width
    console.print(memcheck.table(rows))
    text = console.export_text()
    assert "peak alloc" in text and all(len(line) <= 100 for line in text.splitlines())


def _config(**kw):
    base = {"workload": "transformer", "devices": "cpu:4", "batch_size": 8, "seq_len": 64, "steps": 1}
    return RunConfig(**{**base, **kw}).validate()


@pytest.mark.parametrize(("name", "options", "layout"), [
    ("fsdp", {}, "dp4 mbs2 z3"), ("zero", {"zero_stage": 2}, "dp4 mbs2 z2"), ("tensor_parallel", {}, "tp4 mbs8"),
    ("fsdp_tp", {}, "tp2 dp2 mbs4 z3"), ("pipeline_dist", {}, "pp4 mbs2"), ("context_parallel", {}, "cp4 mbs8"),
    ("fsdp_cp", {}, "dp2 cp2 mbs4 z3"),
])
def test_every_strategy_with_model_state_has_the_planners_layout(name, options, layout):
    config = _config(options=options)
    need = local.need(name, config, shape_model(config))
    assert need["layout"] == layout
    single = local.need("single", config, shape_model(config))
    if name == "context_parallel":  # replicated weights, a slice of every sequence's activations
        assert need["model_state"] == single["model_state"] and need["activations"] < single["activations"]
    else:  # every other one splits or shards the state
        assert need["model_state"] < single["model_state"]
    if name in ("fsdp", "fsdp_cp"):  # sharded over all 4 ranks (fsdp_cp: its dp x cp, one FSDP2 group)
        assert need["model_state"] == pytest.approx(single["model_state"] / 4)
    assert need["total"] == pytest.approx(sum(need[k] for k in memcheck.KINDS))


def test_a_strategy_without_a_state_of_its_own_to_predict_has_none():
    config = _config(devices="cpu:2")
    assert local.need("hogwild", config, shape_model(config)) is None
    cnn = dataclasses.replace(config, workload="cnn", seq_len=0)
    need = local.need("ddp", cnn, shape_model(cnn))  # state only: not the transformer
    assert need["activations"] is None and need["total"] == need["model_state"] > 0
