"""Issue 60's corpus: Hugging Face causal-LM families as transformers builds them (examples/hf_families.py:
dense and mixture-of-experts, learned and rotary positions, tied and untied heads), returned as they are,
through the parent's checks and then `single`, ddp, fsdp, pipeline_dist and tensor_parallel at cpu:2: every
row matches one device, or is left out with its one-line reason. In fp32: the experts' grouped_mm takes no
float64, and these models have no ReLU or max-pool whose decision rounding could flip (docs/oracle.md).
On the transformers installed (the newest the registry had, and the oldest pyproject allows:
docs/your-model.md)."""

import importlib.util

import pytest

from parallel import strategies
from parallel.compare import select_runs
from parallel.config import RunConfig
from parallel.judge import mutants
from parallel.models.usermodel import workload_of
from tests.conftest import ROOT

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install -e '.[hf]')"),
              pytest.mark.timeout(300)]

FAMILIES = ("gpt2", "opt", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gpt_neox", "falcon", "mixtral",
            "qwen2_moe")
FIVE = ["single", "ddp", "fsdp", "pipeline_dist", "tensor_parallel"]
# What each family cannot run, and why, as the parent says it (anything else left out fails the test)
LEFT_OUT = {
    "tensor_parallel": "has no tensor-parallel plan",  # transformers' plan splits no Linear, or asks for a sum
    "pipeline_dist": "has no layers to cut into stages",  # gemma2: scaled embeddings, soft-capped logits
}


def config(family: str) -> RunConfig:
    return RunConfig(model=f"{ROOT / 'examples' / 'hf_families.py'}:{family}", devices="cpu:2", vocab=256,
                     seq_len=32, batch_size=16, steps=2, warmup=1, extras=False).validate()


@pytest.mark.slow
def test_every_family_returned_as_it_is_matches_one_device_or_says_why_not():
    jobs, ran, skipped = [], {}, {}
    for family in FAMILIES:
        c = config(family)  # as `compare` (every strategy) leaves them out, then the parent's checks of the rest
        runnable, left = strategies.resolve(["all"], c.spec, workload_of(c))
        left = {n: why for n, why in left.items() if n in FIVE}
        chosen, failed = select_runs(c, [n for n in FIVE if n in runnable], baseline=True)
        left |= failed
        ran[family] = [s.name for s, _, _ in chosen if s.name != "single"]
        skipped[family] = left
        assert {s.name for s, _, _ in chosen} | left.keys() == set(FIVE) and "single" not in left, (family, left)
        for name, why in left.items():
            assert LEFT_OUT[name] in why, (family, name, why)
        jobs += [mutants.Job(name, cfg.to_json(), "honest") for s, _, cfg in chosen if (name := s.name) != "single"]
    outcomes = iter(mutants.run_jobs(jobs))  # one set of spawned ranks for every run
    for family in FAMILIES:
        for name in ran[family]:
            verdict = next(outcomes).equivalence
            assert verdict.verdict == "match", (family, name, verdict)
    # the two mixture-of-experts families' experts run grouped_mm, which the meta device refuses in fp32:
    # their pipeline's check falls back to a real copy and they run. Qwen3's q_norm and k_norm apply to each
    # rank's heads: transformers 5.24's plan marks them for a gradient sum, which tensor_parallel does (its run
    # above matched); 5.0's does not, and the split refuses the weight it finds beside its split layers
    assert "pipeline_dist" in ran["mixtral"] and "pipeline_dist" in ran["qwen2_moe"]
    from transformers import Qwen3Config

    if "replicated_with_grad_allreduce" in Qwen3Config.base_model_tp_plan.values():
        assert "tensor_parallel" in ran["qwen3"], skipped["qwen3"]
    else:
        assert "self_attn.q_norm" in skipped["qwen3"]["tensor_parallel"], skipped["qwen3"]
    assert sum(len(r) for r in ran.values()) >= 30, ran
