"""The built-in transformer at the planner's shapes (parallel/models/transformer.py): GPT and Llama (RMSNorm, SwiGLU,
RoPE, grouped-query attention), from flags or a preset, counted as the planner counts them, and trained by
the strategies that split it (tensor parallel, pipelines, FSDP, context parallel) to `single`'s result."""

import dataclasses

import pytest
import torch

from parallel import strategies
from parallel.cli import build_parser
from parallel.cliargs import config_from_args
from parallel.config import ConfigError, RunConfig
from parallel.judge import equivalence
from parallel.kit import kv_copies
from parallel.models.transformer import Transformer, rotate
from parallel.models.usermodel import shape_model, workload_of
from parallel.models.workloads import WORKLOADS
from parallel.plan.models import ModelShape
from parallel.world.dist import Dist
from tests.multirank import FP64_MARGIN, _execute, _sharp, _train, run_ranks

LLAMA = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 96, "vocab": 512, "seq_len": 16}


def _compare(*flags: str) -> RunConfig:
    return config_from_args(build_parser().parse_args(["compare", *flags]), default_out=False)


@pytest.mark.parametrize("arch,tied", [("gpt", True), ("gpt", False), ("llama", False)])
def test_the_model_has_the_planners_parameter_count(arch, tied):
    spec = ModelShape(layers=3, hidden=96, heads=6, vocab=1000, seq=24, ffn=200, kv_heads=2 if arch == "llama" else 0,
                     arch=arch)
    model = Transformer(1000, 24, 96, 3, 6, arch, spec.kv_heads, 200, tied)
    head = 0 if tied or arch == "llama" else 1000 * 96 + 1000  # the planner's gpt is tied; untied adds the head
    assert sum(p.numel() for p in model.parameters()) == spec.params + head


def test_a_preset_or_arch_alone_picks_the_transformer_and_flags_override_the_preset():
    c = _compare("--preset", "llama3-8b", "--layers", "2", "--hidden", "512", "--ffn", "1536", "--heads", "8",
                 "--kv-heads", "2", "--seq-len", "128", "--devices", "cpu:2")
    assert (c.workload, c.arch, c.vocab, c.layers, c.hidden, c.heads, c.kv_heads) == (
        "transformer", "llama", 128_256, 2, 512, 8, 2)
    assert (c.batch_size, c.warmup) == (8, 0)  # a shaped transformer's defaults: 8 sequences, not 512; no warm-up
    small = _compare("--arch", "llama", "--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "512",
                     "--seq-len", "16", "--devices", "cpu:2")
    assert small.warmup == 3  # a step of milliseconds on CPUs: warmed up, as any (its first took 129% here)
    w = workload_of(c)
    assert (w.classes, w.input_shape) == (128_256, (128,)) and "(llama3-8b)" in w.description
    model = shape_model(c)  # on the meta device: no memory at any vocabulary
    assert all(p.is_meta for p in model.parameters())
    assert model.blocks[0].attn.k.out_features == 2 * 64 and not hasattr(model.embed.positions, "weight")
    assert _compare("--arch", "gpt", "--devices", "cpu:2").workload == "transformer"
    assert _compare("--preset", "gpt2-small", "--layers", "2", "--devices", "cpu:2").vocab == 50_304


@pytest.mark.parametrize("flags,says", [
    (["--workload", "cnn", "--arch", "llama"], "the cnn workload has its own shape"),
    (["--hidden", "100", "--heads", "8"], "--hidden 100 must divide into --heads 8"),
    (["--heads", "4", "--kv-heads", "3"], "and those into --kv-heads 3"),
    (["--arch", "llama", "--hidden", "60", "--heads", "4"], "a head's 15 must be even"),
    (["--arch", "llama", "--tied"], "--arch llama's are separate"),
    (["--model", "examples/gpt2.py:gpt2", "--vocab", "64", "--seq-len", "8", "--layers", "3"], "your model has"),
])
def test_a_shape_that_cannot_be_built_is_one_line(flags, says):
    with pytest.raises(ConfigError, match=says.replace("(", r"\(")):
        _compare(*flags, "--devices", "cpu:2")


def test_the_default_transformer_is_unchanged_and_the_shapes_differ_where_they_should():
    default = WORKLOADS["transformer"].build_model(0)
    assert sum(p.numel() for p in default.parameters()) == 417_344  # the 0.42M the oracle's tables measured
    llama = workload_of(RunConfig(workload="transformer", **LLAMA)).build_model(0)
    names = {n for n, _ in llama.named_parameters()}
    assert "blocks.0.mlp.w1.weight" in names and "embed.positions.weight" not in names
    assert not any(n.endswith(".bias") for n in names)  # Llama has none
    x = torch.randint(0, 512, (2, 16))
    assert llama(x).shape == (2, 16, 512)


def test_rope_turns_by_the_global_position_so_a_slice_at_its_positions_is_the_whole_ones():
    x = torch.randn(1, 2, 16, 8, dtype=torch.float64)
    whole = rotate(x, torch.arange(16))
    at = torch.tensor([4, 5, 12, 13])  # a zig-zag rank's positions
    assert torch.equal(rotate(x[:, :, at], at), whole[:, :, at])
    assert not torch.allclose(rotate(x[:, :, at], torch.arange(4)), whole[:, :, at])  # local positions differ
    q, k = torch.randn(2, 1, 1, 8, dtype=torch.float64).unbind(0)  # the score depends on the distance alone
    s = [(rotate(q, torch.tensor([p + 3])) * rotate(k, torch.tensor([p]))).sum() for p in (0, 100)]
    assert s[0].item() == pytest.approx(s[1].item(), rel=1e-9)


def _llama(workload, world, options):
    options = dict(options)
    return RunConfig(workload=workload, **LLAMA, devices=f"cpu:{world}", batch_size=4, steps=2, warmup=1,
                     mutant=options.pop("mutant", ""), options=options).validate()


def _judge(runs: list, make=_llama) -> None:
    """Every run of `runs` on 2 spawned ranks against `single` in float64: a match within FP64_MARGIN, or,
    for a run with an injected bug, a mismatch 100 times the rule."""
    results = run_ranks(_train, 2, (runs, make))[0]
    clean = _sharp(make("transformer", 2, {}))
    ref = equivalence.reference_of(clean, *_execute(strategies.get("single"), clean, Dist()))
    for (name, _, options), (row, state) in zip(runs, results, strict=True):
        verdict = equivalence.judge(strategies.get(name), _sharp(make("transformer", 2, options)), ref, row, state)
        if "mutant" in options:
            assert verdict.verdict == "mismatch" and verdict.ratio > 100, verdict
        else:
            assert verdict.verdict == "match" and verdict.ratio < FP64_MARGIN, (name, options, verdict)


@pytest.mark.slow  # spawned ranks, 6-11 s: the fast tier keeps Llama's parts (RoPE, GQA, counts) and the
# same collectives on the GPT shape (test_tensor_parallel.py, test_context_parallel.py)
def test_llama_with_gqa_and_rope_matches_single_split_by_heads_and_sequence_and_a_rope_bug_does_not():
    # The last run is the zig-zag bug on Llama: RoPE turns each token by a position that is not its own
    bug = {"cp_layout": "zigzag", "mutant": "context_parallel:zigzag-positions-unpermuted"}
    _judge([("tensor_parallel", "transformer", {"sequence_parallel": 1}),  # GQA's kv heads split, RMSNorm on T/2
            ("context_parallel", "transformer", {"cp_layout": "zigzag"}), ("context_parallel", "transformer", bug)])


@pytest.mark.slow
def test_llama_matches_single_under_the_other_splitting_strategies():
    _judge([("tensor_parallel", "transformer", {}), ("manual_tp", "transformer", {}), ("fsdp", "transformer", {}),
            ("fsdp_cp", "transformer", {}), ("pipeline_dist", "transformer", {})])  # stages: RoPE in each


def test_tensor_parallel_copies_kv_heads_fewer_than_its_ranks_and_refuses_what_it_cannot_split():
    from parallel.strategies.model import manual_tp

    model = workload_of(RunConfig(workload="transformer", **LLAMA)).build_model(0)
    assert manual_tp.plan_problems(model, 2) is None and manual_tp.plan_problems(model, 4) is None  # 2 kv: copied
    assert "does not divide blocks.0.attn's 2 kv heads" in manual_tp.plan_problems(model, 4, copies=False)  # fsdp_tp
    odd = Transformer(64, 8, 96, 1, 12, "llama", 4, 96)  # 12 heads over 6 ranks: 2 each, but 4 kv heads
    assert "tp 6 is not a multiple of blocks.0.attn's 4 kv heads" in manual_tp.plan_problems(odd, 6)
    more = Transformer(64, 8, 96, 1, 12, "llama", 6, 96)  # 6 kv heads over 4 ranks: 1.5 each, neither way
    assert "tp 4 does not divide blocks.0.attn's 6 kv heads" in manual_tp.plan_problems(more, 4)
    assert kv_copies.describe(model, 4) == "2 kv heads, each copied to 2 ranks (tp 4), their gradients summed there"
    assert kv_copies.describe(model, 2) == "2 kv heads split, 1 a rank"
    assert kv_copies.describe(Transformer(64, 8, 32, 1, 4), 2) == ""  # no grouped-query attention


def test_copied_kv_heads_put_each_heads_copy_on_the_ranks_that_read_it_and_come_back_as_one():
    attention = Transformer(64, 8, 64, 1, 4, "llama", 2, 96).blocks[0].attn  # 4 heads of 16, 2 kv heads
    k = attention.k.weight.detach().clone()
    kv_copies._repeat_rows(attention.k, 16, 2)  # tp 4: each kv head on 2 ranks
    rank_rows = attention.k.weight.detach().chunk(4)  # what the colwise split gives each rank
    for rank in range(4):  # rank r's query heads (one each) read kv head r // 2
        assert torch.equal(rank_rows[rank], k[16 * (rank // 2):16 * (rank // 2 + 1)])
    copies = kv_copies.Copies(2, ("attn.k",), 16, None, (0, 1))
    assert torch.equal(kv_copies.one_copy({"attn.k.weight": attention.k.weight}, copies)["attn.k.weight"], k)


def _mqa(workload, world, options):
    """Llama with one kv head (multi-query attention): at tp 2 each rank holds a copy of it."""
    options = dict(options)
    return RunConfig(workload=workload, **{**LLAMA, "kv_heads": 1}, devices=f"cpu:{world}", batch_size=4, steps=2,
                     warmup=1, mutant=options.pop("mutant", ""), options=options).validate()


@pytest.mark.slow  # spawned ranks
def test_kv_heads_copied_to_more_ranks_match_single_and_copies_left_unsummed_do_not():
    _judge([("manual_tp", "transformer", {}), ("tensor_parallel", "transformer", {"sequence_parallel": 1}),
            ("manual_tp", "transformer", {"mutant": "manual_tp:kv-copies-unsummed"})], make=_mqa)


def test_the_planners_shape_for_a_user_reaches_plan_and_compare_alike():
    c = _compare("--preset", "gpt2-medium", "--layers", "1", "--hidden", "64", "--heads", "4", "--devices", "cpu:2")
    assert dataclasses.asdict(c)["preset"] == "gpt2-medium" and c.seq_len == 1024 and c.heads == 4


def test_on_gpus_with_no_workload_named_the_default_is_gpt2_small_in_bf16_and_says_why(strict_cuda):
    c = _compare("--devices", "cuda:0,1")
    assert (c.workload, c.preset, c.layers, c.hidden, c.vocab, c.seq_len) == ("transformer", "gpt2-small", 12, 768,
                                                                            50_304, 1024)
    assert c.precision == "bf16" and c.batch_size == 16 and "kernel launches" in c.why  # 8 sequences a GPU
    assert c.warmup == 3  # a GPU's step is milliseconds: the usual warm-up
    assert _compare("--devices", "cuda:0,1", "--layers", "2").why == ""  # a shape named: the user's
    named = _compare("--devices", "cuda:0,1", "--workload", "cnn")
    assert (named.workload, named.precision, named.batch_size, named.why) == ("cnn", "fp32", 512, "")
    assert _compare("--devices", "cuda:0,1", "--precision", "fp32").precision == "fp32"  # flags still win
    assert not strict_cuda.entries("init")  # choosing it opens no CUDA context


def test_on_the_cpu_the_default_stays_the_small_cnn(no_cuda):
    c = _compare()
    assert (c.workload, c.precision, c.batch_size, c.why) == ("cnn", "fp32", 512, "")


def test_the_planners_memory_reads_a_llama_shape_from_the_model():
    from parallel.plan import local

    c = RunConfig(workload="transformer", **LLAMA, devices="cpu:2", batch_size=4).validate()
    spec = local.shape_of(shape_model(c), 16)
    assert (spec.arch, spec.layers, spec.hidden, spec.heads, spec.kv_heads, spec.ffn, spec.seq) == (
        "llama", 2, 64, 4, 2, 96, 16)
    assert spec.params == sum(p.numel() for p in shape_model(c).parameters())
    assert local.need("fsdp", c, shape_model(c))["activations"] > 0  # its blocks counted, not only its state
