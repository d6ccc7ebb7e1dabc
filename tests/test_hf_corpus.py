"""Issue 60's corpus: Hugging Face causal-LM families as transformers builds them (examples/hf_families.py:
dense and mixture-of-experts, learned and rotary positions, tied and untied heads), returned as they are,
through the parent's checks and then `single`, ddp, fsdp, pipeline_dist and tensor_parallel at cpu:2: each
family's outcome per strategy is pinned (PINNED: ran and matched one device, or left out with that reason),
so a family that gains or loses a strategy fails the test (issue 71). In fp32: the experts' grouped_mm takes no
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

FIVE = ["single", "ddp", "fsdp", "pipeline_dist", "tensor_parallel"]
RUNS = dict.fromkeys(FIVE, "match")
NO_PLAN = "splits no nn.Linear layer"  # transformers' plan splits nothing the project's split reads
# family -> strategy -> "match" (ran and matched one device) or a piece of the reason it was left out. The
# two mixture-of-experts families' experts run grouped_mm, which the meta device refuses in fp32: their
# pipeline's check falls back to a real copy and they run. Qwen3's tensor_parallel: see pinned().
PINNED = {
    "gpt2": {**RUNS, "tensor_parallel": f"GPT2LMHeadModel {NO_PLAN}"},  # its Conv1D, not nn.Linear
    "opt": {**RUNS, "tensor_parallel": f"OPTForCausalLM {NO_PLAN}",
            "pipeline_dist": "its base model OPTModel has 0 lists of blocks"},  # its blocks sit in a decoder
    "llama": RUNS, "mistral": RUNS, "qwen2": RUNS, "qwen3": RUNS,
    "phi3": {**RUNS, "tensor_parallel": f"Phi3ForCausalLM {NO_PLAN}"},  # a fused qkv
    "gemma2": {**RUNS, "pipeline_dist": "is not its embeddings, blocks, final norm and head run one after"},
    "gpt_neox": RUNS,
    "falcon": {**RUNS, "tensor_parallel": f"FalconForCausalLM {NO_PLAN}"},
    "mixtral": RUNS, "qwen2_moe": RUNS,
}


def pinned() -> dict:
    """PINNED on the transformers installed: Qwen3's q_norm and k_norm apply to each rank's heads; 5.24's plan
    marks them replicated_with_grad_allreduce, which tensor_parallel does (it runs and matches); 5.0's does not,
    and the split refuses the weight it finds beside its split layers."""
    from transformers import Qwen3Config

    if "replicated_with_grad_allreduce" in Qwen3Config.base_model_tp_plan.values():
        return PINNED
    return {**PINNED, "qwen3": {**RUNS, "tensor_parallel": "self_attn.q_norm"}}


def differences(pinned: dict, observed: dict) -> list[str]:
    """Each way `observed` (family -> strategy -> "match", or what else happened: a verdict, a reason it was
    left out) is not `pinned` (-> "match", or a piece of the reason), one line each, naming family and
    strategy."""
    out = []
    for family in sorted(pinned.keys() | observed.keys()):
        want, got = pinned.get(family), observed.get(family)
        if want is None or got is None:
            out.append(f"{family}: {'observed, not pinned' if want is None else 'pinned, not observed'}")
            continue
        names = want.keys() | got.keys()
        for name in [n for n in FIVE if n in names] + sorted(names - set(FIVE)):
            if name not in got:
                out.append(f"{family} {name}: pinned {want[name]!r}, neither ran nor was left out")
            elif name not in want:
                out.append(f"{family} {name}: observed {got[name]!r}, not pinned")
            elif want[name] != got[name] and (want[name] == "match" or got[name] == "match"
                                              or want[name] not in got[name]):
                out.append(f"{family} {name}: pinned {want[name]!r}, observed {got[name]!r}")
    return out


def config(family: str) -> RunConfig:
    return RunConfig(model=f"{ROOT / 'examples' / 'hf_families.py'}:{family}", devices="cpu:2", vocab=256,
                     seq_len=32, batch_size=16, steps=2, warmup=1, extras=False).validate()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                    reason="transformers is not installed (pip install -e '.[hf]')")
def test_every_family_returned_as_it_is_runs_and_is_left_out_as_pinned():
    jobs, ran, observed = [], {}, {}
    for family in PINNED:
        c = config(family)  # as `compare` (every strategy) leaves them out, then the parent's checks of the rest
        runnable, left = strategies.resolve(["all"], c.spec, workload_of(c))
        chosen, failed = select_runs(c, [n for n in FIVE if n in runnable], baseline=True)
        observed[family] = {n: why for n, why in (left | failed).items() if n in FIVE}
        observed[family] |= {s.name: "match" for s, _, _ in chosen if s.name == "single"}  # the baseline
        ran[family] = [s.name for s, _, _ in chosen if s.name != "single"]
        jobs += [mutants.Job(name, cfg.to_json(), "honest") for s, _, cfg in chosen if (name := s.name) != "single"]
    outcomes = iter(mutants.run_jobs(jobs))  # one set of spawned ranks for every run
    for family in PINNED:
        for name in ran[family]:
            verdict = next(outcomes).equivalence.verdict
            observed[family][name] = verdict if verdict == "match" else f"ran, verdict {verdict}"
    found = differences(pinned(), observed)
    assert found == [], "\n".join(found)


def test_the_pinned_check_reports_a_strategy_lost_gained_or_left_out_for_another_reason():
    """differences() can fail: what PINNED says passes, and each way a family's outcome moves is a line."""
    same = {family: dict(row) for family, row in PINNED.items()}  # a piece of a reason is in the reason
    assert differences(PINNED, same) == []
    same["opt"]["pipeline_dist"] = ("it has no layers to cut into stages: its blocks cannot be cut apart: its base "
                                    "model OPTModel has 0 lists of blocks, not one; return 'layers' from the factory")
    assert differences(PINNED, same) == []  # the pinned piece, within the whole reason

    def moved(family, name, outcome):
        seen = {f: dict(row) for f, row in same.items()}
        if outcome is None:
            del seen[family][name]
        else:
            seen[family][name] = outcome
        return differences(PINNED, seen)

    lost = moved("llama", "pipeline_dist", "it has no layers to cut into stages: ...")
    assert lost == ["llama pipeline_dist: pinned 'match', observed 'it has no layers to cut into stages: ...'"]
    assert moved("llama", "pipeline_dist", None) == [
        "llama pipeline_dist: pinned 'match', neither ran nor was left out"]
    assert moved("mixtral", "ddp", "ran, verdict mismatch") == [
        "mixtral ddp: pinned 'match', observed 'ran, verdict mismatch'"]
    gained = moved("gpt2", "tensor_parallel", "match")
    assert gained == ["gpt2 tensor_parallel: pinned 'GPT2LMHeadModel splits no nn.Linear layer', observed 'match'"]
    reason = moved("opt", "pipeline_dist", "it has no layers to cut into stages: its forward() is not ...")
    assert len(reason) == 1 and reason[0].startswith("opt pipeline_dist: pinned 'its base model OPTModel"), reason
    assert moved("falcon", "expert_parallel", "match") == ["falcon expert_parallel: observed 'match', not pinned"]
    assert differences(PINNED, {f: r for f, r in same.items() if f != "qwen2"}) == ["qwen2: pinned, not observed"]
