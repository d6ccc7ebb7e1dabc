"""Context parallelism: ring attention against one device's attention, per rank, in float64; the layouts'
arithmetic; context_parallel and fsdp_cp trained against `single` with their bytes, causal pairs and
activations beside the formulas; torch's context_parallel() refused on CPU with its reason."""

import math

import pytest
import torch
import torch.nn.functional as F

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit.ring_attention import Ring, Split
from parallel.models.usermodel import workload_of
from parallel.strategies.model import context_parallel
from parallel.world.errors import ConfigError
from tests.multirank import judged_on_ranks, run_ranks

pytestmark = pytest.mark.timeout(240)
B, H, T, D = 2, 2, 32, 8


def test_zigzag_balances_the_causal_pairs_and_contiguous_gives_the_last_rank_the_most():
    # The issue's probe: 264 / 264 pairs per head on 2 ranks at T = 32, against 136 / 392 contiguous.
    assert [Split("zigzag", 2, 32).causal_pairs(r) for r in range(2)] == [264, 264]
    assert [Split("contiguous", 2, 32).causal_pairs(r) for r in range(2)] == [136, 392]
    for name in ("contiguous", "zigzag"):
        layout = Split(name, 4, 64)
        held = torch.cat([layout.positions(r) for r in range(4)])
        assert sorted(held.tolist()) == list(range(64))  # every position held once
        assert sum(layout.causal_pairs(r) for r in range(4)) == 64 * 65 // 2
    assert Split("zigzag", 2, 16).positions(0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]


def _attention(rank, world, layout_name, comm, bug):
    """Ring attention on this rank's positions against one device's on the whole sequence (float64):
    the output and the gradients of this rank's q, k, v."""
    g = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*whole, is_causal=True).backward(grad)
    layout = Split(layout_name, world, T)
    idx = layout.positions(rank)
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, idx]
    ring = Ring(None, layout, comm, fused=bug != "math")
    if bug in BUGS:  # put in the ring's place, as context_parallel.apply does under --mutant
        setattr(ring, *BUGS[bug])
    out = ring(*mine)
    out.backward(grad[:, :, idx])
    return {"out": (out - expected).abs().max().item(),
            **{n: (m.grad - w.grad[:, :, idx]).abs().max().item() for n, m, w in zip("qkv", mine, whole, strict=True)}}


BUGS = {"keep_grads_home": ("home", torch.zeros_like), "swap_lse": ("merge", context_parallel.merge_swapped),
        "local_mask": ("mask", context_parallel.mask_by_local_offsets)}


def _every_variant(rank, world):
    """Every layout and comm, with torch's fused CPU kernel and with the math alone (as on GPUs); on 2
    ranks also the bugs."""
    honest = [_attention(rank, world, layout, comm, kernel) for layout in ("contiguous", "zigzag")
              for comm in ("ring", "allgather") for kernel in ("", "math")]
    bugs = {bug: _attention(rank, world, "contiguous", "ring", bug)
            for bug in ("keep_grads_home", "swap_lse", "local_mask")} if world == 2 else {}
    return honest, bugs


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(_every_variant, 2, timeout=60)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ring_attention_matches_one_device_on_every_rank_in_every_layout_and_comm(world, request):
    ranks = request.getfixturevalue("two_ranks") if world == 2 else run_ranks(_every_variant, world, timeout=60)
    for rank, (errors, _) in enumerate(ranks):
        for e in errors:
            assert max(e.values()) < 1e-12, (rank, e)  # float64: the only difference is summation order


def test_each_ring_bug_is_wrong_where_the_issue_says_and_a_one_rank_test_would_miss_the_first(two_ranks):
    ranks = [bugs for _, bugs in two_ranks]
    first, last = ranks[0]["keep_grads_home"], ranks[-1]["keep_grads_home"]
    # dK,dV never carried home: rank 0's K,V were used by rank 1's queries, so its gradients are wrong by
    # order 1; the last rank's K,V are seen by nobody else (contiguous, causal), so it looks right.
    assert first["out"] < 1e-12 and first["q"] < 1e-12 and first["k"] > 0.1 and first["v"] > 0.1
    assert max(last.values()) < 1e-12
    for bug in ("swap_lse", "local_mask"):  # wrong in the output itself on the rank that merges blocks
        assert ranks[-1][bug]["out"] > 0.01, (bug, ranks[-1][bug])


def _config(workload, world, options):
    return RunConfig(workload=workload, seq_len=64, devices=f"cpu:{world}", batch_size=8, steps=3, warmup=1,
                     options=options, check_replicas=True).validate()  # honest: no replica may part


def _check_measured(row, world):
    d, predicted = row.details["context"], row.comm_bytes_predicted
    # Every byte is where the formula puts it: the K,V ring or all-gather, 3 (cp-1) blocks per layer and
    # step, plus the gradients' reduction; measured at the collectives, within 1% (exact on gloo).
    assert abs(row.comm_bytes_per_step - predicted) <= 0.01 * predicted, (row.comm_bytes_per_step, predicted)
    cp = d["cp"]
    assert d["attention_bytes_predicted"] == 3 * (cp - 1) * d["kv_block_bytes"] * 2  # 2 attention layers
    pairs, formula = d["causal_pairs_per_rank"], d["causal_pairs_formula"]
    assert pairs[:cp] == formula  # counted in the blocks computed, against the layout's sum over positions
    if d["layout"] == "zigzag":
        assert len(set(pairs)) == 1
    else:  # contiguous: rank r computes c (r c) + c (c + 1) / 2 pairs, c = T / cp
        c = 64 // cp
        assert pairs[:cp] == [c * r * c + c * (c + 1) // 2 for r in range(cp)]
    if "layer_activation_bytes" in row.details:  # one layer on T/cp positions: the formula (activations.py), exact
        assert row.details["layer_activation_bytes"] == row.details["layer_activation_predicted"]
        assert row.details["layer_activation_layout"]["cp"] == cp
    for kind in ("activation_bytes", "attention_activation_bytes"):  # everything a rank saves is per token
        ratio = d[f"{kind}_per_rank"][0] / d[f"single_{kind}_per_rank"][0]
        assert abs(ratio * cp - 1) < 0.10, (kind, ratio, cp)


def test_context_parallel_and_fsdp_cp_match_single_on_2_ranks_with_their_measurements():
    # Both layouts and both comms (the fast tier's parity of these two: test_oracle.py leaves them here)
    runs = [("context_parallel", "transformer", {"cp_layout": "contiguous", "cp_comm": "ring"}),
            ("context_parallel", "transformer", {"cp_layout": "zigzag", "cp_comm": "allgather"}),
            ("fsdp_cp", "transformer", {"cp_layout": "zigzag", "cp_comm": "ring"})]
    for row in judged_on_ranks(2, runs, _config):
        _check_measured(row, 2)


@pytest.mark.slow
def test_context_parallel_and_fsdp_cp_match_single_on_4_ranks():
    runs = [("context_parallel", "transformer", {"cp_layout": "zigzag", "cp_comm": "ring"}),
            ("context_parallel", "transformer", {"cp_layout": "contiguous", "cp_comm": "allgather"}),
            ("fsdp_cp", "transformer", {"cp_layout": "zigzag", "cp_comm": "ring"}),  # dp 2 x cp 2
            ("fsdp_cp", "transformer", {"cp_layout": "contiguous", "cp_comm": "allgather", "cp": 4})]
    rows = judged_on_ranks(4, runs, _config, timeout=200)
    for row in rows:
        _check_measured(row, 4)
    shards = rows[2].details["model_state_bytes_per_device"]
    assert max(shards) < rows[0].details["model_state_bytes_per_device"][0] / 3  # FSDP2 over all 4 ranks


def test_the_sequence_length_of_the_built_in_transformer_and_what_cannot_be_split():
    assert RunConfig(workload="transformer", seq_len=256).validate().seq_len == 256
    with pytest.raises(ConfigError, match="the cnn workload has none"):
        RunConfig(workload="cnn", seq_len=64).validate()
    s = strategies.get("context_parallel")
    with pytest.raises(ConfigError, match="not divisible by 8"):
        s.validate(RunConfig(workload="transformer", seq_len=36, devices="cpu:4").validate())
    with pytest.raises(ConfigError, match="--cp 1 splits no sequence"):
        s.validate(RunConfig(workload="transformer", devices="cpu:2", options={"cp": 1}).validate())
    assert s.unsupported(workload_of(RunConfig(workload="mlp"))).startswith("it has no attention to split")
    assert math.isclose(Split("zigzag", 2, 32).causal_pairs(0), 264)


def test_torch_context_parallel_is_refused_on_cpu_with_its_reason(refused):
    refused(["compare", "--workload", "transformer", "--strategies", "single,torch_cp", "--devices", "cpu:2"],
            "torch_cp cannot run on cpu:2: needs CUDA: torch's context_parallel() dispatches only CUDA's")


def test_preflight_on_gpus_plans_the_sequence_strategies_on_the_transformer(strict_cuda):
    from parallel import preflight
    from parallel.compare import select_runs

    strict_cuda.count = 2
    config = RunConfig(devices="cuda:0,1").validate()  # the preflight's own workload, cnn: no attention
    found = preflight.elsewhere_names(config, ["all"])
    names = found["sequence"]
    assert names == ["context_parallel", "fsdp_cp", "torch_cp", "ulysses", "fsdp_ulysses"]
    assert found["experts"] == ["expert_parallel"]
    assert preflight.elsewhere_names(RunConfig(devices="cpu:2").validate(), ["all"]) == {}  # the suite covers CPU
    seq = RunConfig(devices="cuda:0,1", **preflight.SEQUENCE_RUN).validate()
    chosen, skipped = select_runs(seq, names, strict=False)
    assert [s.name for s, _, _ in chosen] == ["single", *names] and not skipped
    shared = RunConfig(devices="cuda:0x2", **preflight.SEQUENCE_RUN).validate()  # gloo: no p2p, no DTensor
    chosen, skipped = select_runs(shared, names, strict=False)
    assert "point to point" in skipped["context_parallel"] and "DTensor" in skipped["torch_cp"]
