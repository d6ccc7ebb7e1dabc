"""Ulysses: the all-to-all attention against one device's, per rank, in float64 (heads split, kv heads sent or
copied, a ring inside it); the bound the heads put on it; ulysses and fsdp_ulysses trained against `single`
with their bytes, causal pairs and activations beside the formulas."""

import dataclasses

import pytest
import torch
import torch.distributed as td
import torch.nn.functional as F

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit.ulysses import heads_problem, kv_heads_sent, placed
from parallel.strategies.model import ulysses
from parallel.world.errors import ConfigError
from tests.multirank import judged_on_ranks, run_ranks

pytestmark = pytest.mark.timeout(240)
B, T, D = 2, 32, 8


def _attention(rank, world, heads, kv_heads, ring, layout="contiguous", bug=False):
    """Ulysses (over world / ring ranks, a ring of `ring` inside) on this rank's positions against one
    device's attention on the whole sequence (float64): the largest error of the output and of the
    gradients of this rank's q, k, v."""
    g = torch.Generator().manual_seed(0)
    q, grad = (torch.randn(B, heads, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, kv_heads, T, D, generator=g, dtype=torch.float64) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    group = heads // kv_heads
    out = F.scaled_dot_product_attention(whole[0], *(t.repeat_interleave(group, 1) for t in whole[1:]), is_causal=True)
    out.backward(grad)
    attend, idx = placed(world, world, ring, layout, T, rank, td.distributed_c10d.default_pg_timeout)
    if bug:
        attend.heads_back = ulysses.heads_rank_minor
    mine = [t[:, :, idx].clone().requires_grad_() for t in (q, k, v)]
    got = attend(*mine)
    got.backward(grad[:, :, idx])
    return max([(got - out[:, :, idx]).abs().max().item()] +
               [(m.grad - w.grad[:, :, idx]).abs().max().item() for m, w in zip(mine, whole, strict=True)])


def _two(rank, world):
    return {"mha": _attention(rank, world, 4, 4, 1), "gqa": _attention(rank, world, 4, 2, 1),
            "copies": _attention(rank, world, 4, 1, 1), "bug": _attention(rank, world, 4, 4, 1, bug=True)}


def _four(rank, world):
    return {"mha": _attention(rank, world, 4, 4, 1), "copies": _attention(rank, world, 8, 2, 1),
            "hybrid": _attention(rank, world, 4, 4, 2, "zigzag"), "hybrid gqa": _attention(rank, world, 4, 1, 2),
            "hybrid, a head a rank": _attention(rank, world, 2, 2, 2)}


def test_ulysses_matches_one_device_on_every_rank_and_its_bug_does_not():
    # 2 ranks: every head's own, kv heads split (2 over 2), and copied (1 kv head sent twice)
    for rank, errors in enumerate(run_ranks(_two, 2, timeout=60)):
        bug = errors.pop("bug")
        assert max(errors.values()) < 1e-12, (rank, errors)  # float64: the same products, another order
        assert bug > 0.01, (rank, bug)  # heads laid back rank-minor: another head's output in each place


@pytest.mark.slow
def test_ulysses_and_the_hybrid_match_one_device_on_4_ranks():
    for rank, errors in enumerate(run_ranks(_four, 4, timeout=90)):
        assert max(errors.values()) < 1e-12, (rank, errors)


def test_the_heads_bound_the_all_to_all_and_what_it_sends():
    assert heads_problem(4, 4, 2) is None and heads_problem(8, 2, 4) is None  # kv heads copied twice
    assert "4 do not divide by 8" in heads_problem(4, 4, 8)
    assert "neither divide" in heads_problem(12, 3, 4)
    assert [kv_heads_sent(k, 4) for k in (8, 4, 2, 1)] == [8, 4, 4, 4]
    s = strategies.get("ulysses")
    cpu8 = RunConfig(workload="transformer", devices="cpu:8", seq_len=64).validate()
    with pytest.raises(ConfigError, match="4 do not divide by 8"):  # the transformer's 4 heads
        s.validate(cpu8)
    s.validate(dataclasses.replace(cpu8, options={"ring": 2}).validate())  # a2a over 4, a ring of 2
    cpu4 = RunConfig(workload="transformer", devices="cpu:4", seq_len=64, options={"ring": 4}).validate()
    with pytest.raises(ConfigError, match="that is context_parallel"):
        s.validate(cpu4)
    with pytest.raises(ConfigError, match="not divisible by the 4 ranks"):
        s.validate(RunConfig(workload="transformer", devices="cpu:4", seq_len=66).validate())


def _config(workload, world, options):
    options = dict(options)
    shape = {"arch": "llama", "kv_heads": options.pop("kv_heads")} if "kv_heads" in options else {}
    return RunConfig(workload=workload, seq_len=64, devices=f"cpu:{world}", batch_size=8, steps=3, warmup=1,
                     options=options, check_replicas=True, **shape).validate()  # honest: no replica may part


def _check_measured(row):
    d, predicted = row.details["context"], row.comm_bytes_predicted
    # Every byte where the formula puts it: four all-to-alls forward and four backward per layer, the ring's
    # blocks inside (--ring), the gradients' reduction; measured at the collectives, within 1% (exact on gloo)
    assert abs(row.comm_bytes_per_step - predicted) <= 0.01 * predicted, (row.comm_bytes_per_step, predicted)
    assert d["layout"].startswith("a2a")
    assert d["causal_pairs_per_rank"][:d["cp"]] == d["causal_pairs_formula"]
    if "layer_activation_bytes" in row.details:  # one layer on T/cp positions, the heads' output kept twice
        assert row.details["layer_activation_bytes"] == row.details["layer_activation_predicted"]
        assert "a2a" in row.details["layer_activation_terms"]


def test_ulysses_and_fsdp_ulysses_match_single_on_2_ranks_with_their_measurements():
    runs = [("ulysses", "transformer", {}), ("ulysses", "transformer", {"kv_heads": 1}),  # Llama, 1 kv head copied
            ("fsdp_ulysses", "transformer", {})]
    rows = judged_on_ranks(2, runs, _config)
    for row in rows:
        _check_measured(row)
    d = rows[0].details["context"]  # cp 2, 2 layers: 8 all-to-alls of q-sized tensors x 1/2 = 2 K,V blocks a
    assert d["attention_bytes_predicted"] == 2 * d["kv_block_bytes"] * 2  # layer, where the ring sends 3


@pytest.mark.slow
def test_ulysses_the_hybrid_and_fsdp_over_it_match_single_on_4_ranks():
    runs = [("ulysses", "transformer", {}), ("ulysses", "transformer", {"ring": 2, "cp_layout": "zigzag"}),
            ("ulysses", "transformer", {"kv_heads": 2, "ring": 2, "cp_comm": "allgather"}),
            ("fsdp_ulysses", "transformer", {"ring": 2})]
    for row in judged_on_ranks(4, runs, _config, timeout=200):
        _check_measured(row)


def test_the_crossover_tool_times_every_mode_and_counts_its_bytes(capsys):
    from parallel.tools import cp_crossover

    assert [m for m, _ in cp_crossover.modes(4)] == ["ring", "a2a", "a2a 2 x ring 2"]
    rows = cp_crossover.measure([32], [2], heads=2, d=4, rounds=1)
    sent = {r["mode"]: r["sent_bytes"] for r in rows}
    block = 16 * 2 * 4 * 4  # one rank's K or V: 16 positions, 2 heads of 4, fp32
    assert sent == {"ring": 3 * 2 * block, "a2a": 8 / 2 * block}  # 3 (C-1) K,V blocks; 8 (U-1)/U tensors
    assert cp_crossover.main(["--ranks", "3", "--seq", "32"]) == 2  # bad input: one line, exit 2
    assert capsys.readouterr().err.count("\n") == 1
