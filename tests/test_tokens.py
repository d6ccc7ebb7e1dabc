"""Uneven tokens (--tokens padded; docs/loss.md): the batches, the global token mean whatever the split, and
the strategies that split a padded batch matching one device's training on it."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from parallel.config import ConfigError, RunConfig
from parallel.loop.tokens import TokenMean, loss_of
from parallel.models.data import IGNORE, PAD
from parallel.models.usermodel import workload_of
from tests.conftest import ROOT
from tests.multirank import judged_on_ranks

pytestmark = pytest.mark.timeout(300)


def _data(tokens: str, batch: int = 64):
    workload = workload_of(RunConfig(workload="transformer", tokens=tokens, batch_size=batch).validate())
    return workload, workload.dataset(0, batch)


def test_a_padded_batch_is_the_even_one_cut_to_drawn_lengths_and_its_shares_hold_different_counts():
    _, even = _data("even")
    workload, padded = _data("padded")
    (xe, ye), (x, y) = even.batch(3), padded.batch(3)
    real = y != IGNORE
    length = real.sum(1)
    assert length.min() >= 1 and length.max() <= 32 and len(set(length.tolist())) > 10  # drawn, not fixed
    assert torch.equal(real, torch.arange(32) < length[:, None])  # a document, then padding to the end
    assert torch.equal(x[real], xe[real]) and torch.equal(y[real], ye[real]) and bool((x[~real] == PAD).all())
    shares = [int((padded.batch(3, r, 4)[1] != IGNORE).sum()) for r in range(4)]
    assert len(set(shares)) == 4 and sum(shares) == int(real.sum())  # uneven ranks, the same tokens in all
    assert padded.density(3) == pytest.approx(real.sum().item() / real.numel())
    assert even.density(3) is None and loss_of(workload_of(RunConfig(workload="transformer").validate())) \
        is workload_of(RunConfig(workload="transformer").validate()).loss  # even: the loss as it always was


def test_a_packed_batch_is_documents_one_after_another_each_starting_with_bos():
    from parallel.models.data import BOS

    _, packed = _data("packed")
    x, y = packed.batch(3)
    begins = x == BOS
    assert bool(begins[:, 0].all()) and int(begins.sum()) > 2 * x.shape[0]  # several documents a sequence
    assert torch.equal((y == IGNORE)[:, :-1], begins[:, 1:])  # the target before a document's BOS, and no other
    assert not bool((y[y != IGNORE] == BOS).any()) and not bool((x[~begins] == BOS).any())  # BOS only starts one
    assert packed.density(3) == pytest.approx((y != IGNORE).sum().item() / y.numel())


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_a_packed_sequence_computes_each_document_as_if_it_were_alone(arch):
    """Positions restart at each BOS (learned, or rotary per row) and attention stays inside the document."""
    from parallel.models.data import BOS

    shape = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "vocab": 64,
             "seq_len": 32} if arch == "llama" else {}
    workload = workload_of(RunConfig(workload="transformer", tokens="packed", batch_size=8, **shape).validate())
    x, _ = workload.dataset(0, 8).batch(0)
    packed, alone = workload.build_model(0).double(), workload.build_model(0).double()
    alone.packed = False
    out, row = packed(x), int((x == BOS).sum(1).argmax())
    edges = [*(x[row] == BOS).nonzero().flatten().tolist(), x.shape[1]]
    assert len(edges) > 3
    for a, b in zip(edges[:-1], edges[1:], strict=False):
        torch.testing.assert_close(out[row:row + 1, a:b], alone(x[row:row + 1, a:b]), rtol=0, atol=1e-12)


def test_packing_is_refused_where_the_document_mask_cannot_reach_and_by_a_model_without_one():
    from parallel import strategies

    config = RunConfig(workload="transformer", tokens="packed", devices="cpu:2").validate()
    workload = workload_of(config)
    assert "a stage after the first never sees" in strategies.get("pipeline_dist").unsupported(workload)
    assert "masks by positions, not by document" in strategies.get("context_parallel").unsupported(workload)
    assert strategies.get("ddp").unsupported(workload) is None and strategies.get("manual_tp").unsupported(workload) \
        is None
    with pytest.raises(ConfigError, match="the built-in transformer's does"):
        RunConfig(model=f"{ROOT / 'examples' / 'gpt2.py'}:gpt2", vocab=64, seq_len=16, tokens="packed").validate()


def test_a_workload_without_tokens_refuses_them():
    with pytest.raises(ConfigError, match="the cnn workload has no tokens"):
        RunConfig(workload="cnn", tokens="padded").validate()


@pytest.mark.parametrize("split", ["rows", "positions", "rows then positions"])
def test_equal_pieces_averaged_uniformly_give_the_global_token_mean(split):
    """What every strategy's average of its pieces comes to with TokenMean: one device's loss, however the
    batch is cut (ranks, micro-batches, sequence shards); each piece's own mean does not."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 12, 5, generator=g, dtype=torch.float64)
    y = torch.randint(0, 5, (8, 12), generator=g)
    y[torch.arange(12) >= torch.randint(1, 13, (8, 1), generator=g)] = IGNORE
    whole = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    rows = [(logits[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)]
    pieces = {"rows": rows, "positions": [(logits[:, j:j + 3], y[:, j:j + 3]) for j in range(0, 12, 3)],
              "rows then positions": [(lo[:, j:j + 6], yy[:, j:j + 6]) for lo, yy in rows for j in (0, 6)]}[split]
    loss = TokenMean(lambda o, t: F.cross_entropy(o.flatten(0, -2), t.flatten(), ignore_index=IGNORE))
    loss.weigh((y != IGNORE).sum().item() / y.numel())
    assert sum(loss(lo, yy) for lo, yy in pieces) / len(pieces) == pytest.approx(whole.item(), rel=1e-12)
    own = [F.cross_entropy(lo.flatten(0, 1), yy.flatten(), ignore_index=IGNORE).item() for lo, yy in pieces]
    empty = [bool((yy == IGNORE).all()) for _, yy in pieces]
    assert [math.isnan(o) for o in own] == empty  # a piece of padding alone: its own mean is NaN
    kept = [o for o, e in zip(own, empty, strict=True) if not e]
    assert abs(sum(kept) / len(kept) - whole.item()) > 1e-3  # and the others' average is not the global mean


def _padded(workload: str, world: int, options: dict) -> RunConfig:
    return RunConfig(workload=workload, devices=f"cpu:{world}", batch_size=16, steps=2, warmup=1, tokens="padded",
                     options=options, precision="fp64", check_replicas=True).validate()


@pytest.mark.slow
def test_a_padded_batch_split_by_ranks_micro_batches_accumulation_and_shards_trains_as_one_device():
    """In float64, within the honest margin: each split that averaged per-piece means before the fix
    (docs/loss.md's table)."""
    runs = [("manual_ddp", "transformer", {}), ("ddp", "transformer", {"accum": 2}),
            ("pipeline_dist", "transformer", {}), ("context_parallel", "transformer", {"cp_layout": "contiguous"}),
            ("fsdp", "moe", {}), ("tensor_parallel", "transformer", {"loss_parallel": 1})]
    judged_on_ranks(2, runs, _padded, timeout=280)


def _packed(workload: str, world: int, options: dict) -> RunConfig:
    return RunConfig(workload=workload, devices=f"cpu:{world}", batch_size=16, steps=2, warmup=1, tokens="packed",
                     options=options, precision="fp64", check_replicas=True).validate()


@pytest.mark.slow
def test_packed_sequences_split_by_ranks_and_by_heads_train_as_one_device():
    runs = [("ddp", "transformer", {"accum": 2}), ("manual_tp", "transformer", {}),
            ("tensor_parallel", "transformer", {"sequence_parallel": 1}), ("expert_parallel", "moe", {})]
    judged_on_ranks(2, runs, _packed, timeout=280)


def test_the_report_says_how_uneven_the_shares_were():
    from parallel.report.overview import run_facts

    config = RunConfig(workload="transformer", tokens="padded", devices="cpu:4", batch_size=64, steps=2,
                       warmup=1).validate()
    facts = run_facts(config)
    _, data = _data("padded")
    shares = [int((data.batch(step, r, 4)[1] != IGNORE).sum()) for step in range(3) for r in range(4)]
    assert facts["real_tokens_per_share"] == [min(shares), max(shares)] and facts["shares"] == 4
    assert "real_tokens_per_share" not in run_facts(RunConfig(workload="transformer").validate())
    packed = run_facts(dataclasses.replace(config, tokens="packed"))
    _, data = _data("packed")
    shares = [int((data.batch(step, r, 4)[1] != IGNORE).sum()) for step in range(3) for r in range(4)]
    assert packed["real_tokens_per_share"] == [min(shares), max(shares)] and not packed["own_mean_loss"]


def test_only_cross_entropy_the_harness_takes_itself_is_weighed_and_the_held_out_set_is_read_as_packed():
    import types

    from parallel.loop.tokens import weighable
    from parallel.models.data import BOS

    assert weighable(types.SimpleNamespace(no_logits_loss="", loss_fn=None))
    assert not weighable(types.SimpleNamespace(no_logits_loss="", loss_fn=lambda o, t: o.sum()))  # a factory's
    assert not weighable(types.SimpleNamespace(no_logits_loss="label smoothing", loss_fn=None))  # a model's own
    x, y = _data("packed")[1].heldout(8)
    assert bool((x[:, 0] == BOS).all()) and not bool((x[:, 1:] == BOS).any()) and not bool((y == IGNORE).any())


SMOOTHED = '''
import torch
import torch.nn.functional as F
from torch import nn


class Smoothed(nn.Module):
    """A token model whose own loss is label-smoothed cross-entropy: not cross-entropy over its logits."""

    def __init__(self, vocab, seq_len, sums):
        super().__init__()
        self.embed, self.sums = nn.Embedding(vocab, 16), sums
        self.mix = nn.Linear(16 * seq_len, 16 * seq_len)
        self.head = nn.Linear(16, vocab)

    def forward(self, idx, targets=None):
        b, t = idx.shape
        logits = self.head(torch.tanh(self.mix(self.embed(idx).reshape(b, -1))).reshape(b, t, -1))
        if targets is None:
            return {"logits": logits}
        flat = logits.flatten(0, 1), targets.flatten()
        if self.sums:  # the sum over the real targets and their count: the harness can weigh it
            return {"logits": logits, "loss_sum": F.cross_entropy(*flat, label_smoothing=0.1, reduction="sum"),
                    "tokens": (targets != -100).sum()}
        return {"logits": logits, "loss": F.cross_entropy(*flat, label_smoothing=0.1)}  # a mean it cannot weigh


def summed(vocab=64, seq_len=16):
    return Smoothed(vocab, seq_len, sums=True)


def mean(vocab=64, seq_len=16):
    return Smoothed(vocab, seq_len, sums=False)
'''


def test_a_model_that_returns_its_loss_as_a_sum_and_a_count_is_weighed_and_one_that_returns_a_mean_is_not(tmp_path):
    """Uneven tokens through a model whose own loss is not cross-entropy over its logits (label smoothing):
    as (sum, count) every split matches one device; as a mean the harness cannot weigh, ddp's ranks do not,
    and the report's note says how far a token's weight went."""
    from parallel.judge import mutants
    from parallel.report.overview import run_facts

    (tmp_path / "smoothed.py").write_text(SMOOTHED)
    runs = {kind: RunConfig(model=f"{tmp_path / 'smoothed.py'}:{kind}", vocab=64, seq_len=16, devices="cpu:2",
                            batch_size=16, steps=2, warmup=1, tokens="padded", precision="fp64", extras=False)
            .validate() for kind in ("summed", "mean")}
    jobs = [mutants.Job("ddp", runs[kind].to_json(), "honest") for kind in ("summed", "mean")]
    summed, mean = (o.equivalence for o in mutants.run_jobs(jobs))
    assert summed.verdict == "match" and summed.ratio < 0.01, summed
    assert mean.verdict == "mismatch", mean
    assert not run_facts(runs["summed"])["own_mean_loss"] and run_facts(runs["mean"])["own_mean_loss"]
