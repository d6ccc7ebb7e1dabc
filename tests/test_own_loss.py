"""Models as users have them (#44): a forward that takes `targets` or `labels` and returns its own loss, as a
tuple (nanoGPT's `(logits, loss)`), a dict or a ModelOutput (tests/test_hf.py), is trained on that loss by
every strategy that runs it, each matching `single`; those that hold only logits are skipped where that
loss is another one; what cannot be trained is refused in one line."""

import dataclasses
import json
import textwrap

import pytest
import torch
import torch.nn.functional as F

from parallel import strategies
from parallel.config import RunConfig
from parallel.models import usermodel
from parallel.models.outputs import call, logits_of, loss_in
from parallel.worker import execute
from parallel.world.dist import Dist
from tests.conftest import ROOT, in_process, judged
from tests.multirank import FP64_MARGIN, judged_on_ranks

EXAMPLES = ROOT / "examples"
LOGITS_ONLY = {"manual_dp", "data_parallel", "model_parallel", "pipeline", "pipeline_dist"}  # take CE over logits

MODELS = textwrap.dedent("""
    import sys
    import torch
    import torch.nn.functional as F
    from torch import nn

    sys.path.insert(0, EXAMPLES)
    import nanogpt

    def tiny(seed, vocab, seq_len):  # examples/nanogpt.py at a test's size: 2 blocks of width 32
        return nanogpt.nanogpt(seed, vocab, seq_len, n_layer=2, n_head=2, n_embd=32)

    class Labelled(nn.Module):  # a classifier in the style of a library's: forward(x, labels) -> dict
        def __init__(self, smoothing=0.0, form="dict"):
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(48, 32), nn.Tanh())
            self.out = nn.Linear(32, 5)
            self.smoothing, self.form = smoothing, form

        def forward(self, x, labels=None):
            logits = self.out(self.body(x))
            if labels is None:
                return {"logits": logits}
            loss = F.cross_entropy(logits, labels, label_smoothing=self.smoothing)
            if self.form == "per-sample":
                loss = F.cross_entropy(logits, labels, reduction="none")
            if self.form == "detached":
                loss = loss.detach()
            if self.form == "no-loss":
                return {"logits": logits}
            return {"logits": logits, "loss": loss}

    def labelled(seed):
        return Labelled()

    def smoothed(seed):  # its own loss is not cross-entropy over its logits
        return Labelled(smoothing=0.1)

    def per_sample(seed):
        return Labelled(form="per-sample")

    def detached(seed):
        return Labelled(form="detached")

    def no_loss(seed):  # takes labels, returns no loss: a model like any other
        return Labelled(form="no-loss")

    def both(seed):
        return {"model": Labelled(), "loss": lambda out, y: F.cross_entropy(out["logits"], y)}

    class Regressor(nn.Module):  # forward(x, targets) -> (prediction, mean squared error): float targets
        def __init__(self):
            super().__init__()
            self.body, self.out = nn.Sequential(nn.Flatten(), nn.Linear(48, 8), nn.Tanh()), nn.Linear(8, 1)

        def forward(self, x, targets=None):
            pred = self.out(self.body(x))[:, 0]
            return pred if targets is None else (pred, ((pred - targets) ** 2).mean())

    def regressor(seed):
        return Regressor()

    class LastOnly(nn.Module):  # the inference shortcut, with no way to ask for every position
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(64, 16), nn.Linear(16, 64)

        def forward(self, idx):
            return self.head(self.embed(idx)[:, [-1], :])

    def last_only(seed):
        return LastOnly()
""")

TOKENS = {"vocab": 64, "seq_len": 16}
CLASSES = {"input_shape": "3,4,4", "classes": 5}


@pytest.fixture
def models(tmp_path):
    path = tmp_path / "own_loss_models.py"
    path.write_text(MODELS.replace("EXAMPLES", repr(str(EXAMPLES))))
    return path


def _config(model: str, world: int, options: dict) -> RunConfig:  # judged_on_ranks imports it
    data = TOKENS if model.endswith((":tiny", ":nanogpt")) else CLASSES
    return RunConfig(model=model, devices=f"cpu:{world}", batch_size=16, steps=2, warmup=1, extras=False,
                     **data).validate()


def test_the_loss_and_the_logits_are_read_from_every_form():
    logits, loss = torch.randn(2, 3, 5), torch.tensor(1.5)
    for out in ((logits, loss), (loss, logits), [logits, loss], {"logits": logits, "loss": loss},
                (loss, logits, torch.randn(2, 3))):  # the last: a library's tuple, (loss, logits, cache)
        assert logits_of(out) is logits and loss_in(out) is loss, out
    assert loss_in(logits) is None and loss_in((logits, None)) is None and loss_in({"logits": logits}) is None


def test_a_nanogpt_style_model_is_called_with_its_targets_and_trained_on_its_loss(models):
    c = _config(f"{models}:tiny", 2, {})
    w = usermodel.workload_of(c)
    assert w.targets == "targets" and w.no_logits_loss == "" and w.tied == "lm_head.weight = embed.wte.weight"
    assert "trained on its own loss (forward's 'targets')" in usermodel.describe(w)
    assert w.layer_names == ("embed", "h.0", "h.1", "ln_f", "lm_head")  # found: its children run in order
    model, (x, y) = w.build_model(0), w.dataset(0, 4).batch(0)
    assert model(x)[0].shape == (4, 1, 64) and model(x)[1] is None  # the shortcut, left to generation
    logits, loss = call(model, x, y)  # every position's logits, and the loss the workload trains on
    assert logits.shape == (4, 16, 64) and torch.equal(w.loss((logits, loss), y), loss)
    assert torch.equal(loss, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    run, skipped = strategies.resolve(["all"], c.spec, w)
    assert LOGITS_ONLY <= set(run) and {"ddp", "fsdp", "zero", "manual_tp", "tensor_parallel"} <= set(run)
    assert model.generate(x[:, :3], 4).shape == (4, 7)  # the shortcut's use: the next token's scores


def test_a_nanogpt_style_model_matches_single_through_the_strategies(models):
    """In float64 (judged_on_ranks): its own loss in ddp, fsdp and tensor_parallel (the loss inside
    forward, each rank's mean over its tokens); cross-entropy over the last stage's logits in pipeline_dist
    and over the gathered ones in manual_dp (each replica given its chunk of the targets); a dict-returning
    model that takes `labels` under ddp."""
    nano, labelled = f"{models}:tiny", f"{models}:labelled"
    runs = [("ddp", nano, {}), ("fsdp", nano, {}), ("tensor_parallel", nano, {}), ("pipeline_dist", nano, {}),
            ("ddp", labelled, {})]
    judged_on_ranks(2, runs, _config)  # each a match within FP64_MARGIN, or it raises
    _, verdict = judged("manual_dp", dataclasses.replace(_config(nano, 2, {}), precision="fp64"))
    assert verdict.verdict == "match" and verdict.ratio < FP64_MARGIN, verdict


def _cut_before_the_head(model: str, world: int, options: dict) -> RunConfig:  # judged_on_ranks imports it
    return dataclasses.replace(_config(model, world, options), cuts={"params:2": [0, 4, 5]},
                               options={"balance": "params"}).validate()


def test_a_stage_holding_only_the_tied_head_still_joins_the_clips_norm(models):
    """nanoGPT's head has no bias and is its token embedding: cut before it, the last stage holds nothing
    but a copy of a weight every stage holds, so its own share of the norm needs no reduce. The other stage's
    does, and the reduce is one collective: the stages must agree to make it (a time cut put the head alone
    under load, and rank 0 waited in the norm's all-reduce while rank 1 had gone on)."""
    rows = judged_on_ranks(2, [("pipeline_dist", f"{models}:tiny", {})], _cut_before_the_head, timeout=40)
    row = rows[0]
    # rank 1 holds the head alone: its weight, gradient and AdamW's two moments in float64, and its step
    assert row.details["model_state_bytes_per_device"][1] == 4 * 64 * 32 * 8 + 8 and row.grad_norms[""]


def test_a_loss_that_is_not_cross_entropy_is_trained_and_strategies_holding_logits_say_why_not(models):
    c = _config(f"{models}:smoothed", 2, {})
    w = usermodel.workload_of(c)
    assert w.targets == "labels" and "its own loss is not cross-entropy over its logits" in w.no_logits_loss
    run, skipped = strategies.resolve(["all"], c.spec, w)
    assert {"single", "ddp", "fsdp", "zero", "hogwild"} <= set(run) and not LOGITS_ONLY & set(run)
    assert "and this strategy takes cross-entropy over its last stage's logits" in skipped["pipeline_dist"]
    assert "over the gathered logits" in skipped["manual_dp"]
    # single's first loss is the model's own (label-smoothed) loss on the first batch, not cross-entropy
    row, _ = execute(strategies.get("single"), c, Dist())
    model, (x, y) = w.build_model(c.seed), w.dataset(c.seed, c.batch_size).batch(0)
    with torch.no_grad():
        out = model(x, labels=y)
    assert row.losses[0] == pytest.approx(float(out["loss"]), rel=1e-6)
    assert abs(row.losses[0] - float(F.cross_entropy(out["logits"], y))) > 1e-3


def test_a_loss_of_float_targets_is_trained_too_where_cross_entropy_could_not_be(models, tmp_path):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 4, 4, generator=g), torch.randn(64, generator=g)
    torch.save({"x": x, "y": y}, tmp_path / "floats.pt")
    c = RunConfig(model=f"{models}:regressor", data=str(tmp_path / "floats.pt"), devices="cpu:2", batch_size=16,
                  steps=2, warmup=1, extras=False).validate()
    w = usermodel.workload_of(c)
    assert w.targets == "targets" and w.no_logits_loss == ("its own loss is not cross-entropy over its logits: its "
                                                           "output (4,) and targets (4,) are not logits and class "
                                                           "indices")
    run, skipped = strategies.resolve(["all"], c.spec, w)
    assert "ddp" in run and "manual_dp" in skipped and "pipeline" in skipped
    row, _ = execute(strategies.get("single"), c, Dist())
    model = w.build_model(c.seed)
    with torch.no_grad():
        first = model(x[:16], targets=y[:16])[1]
    assert row.losses[0] == pytest.approx(float(first), rel=1e-6)


def test_a_forward_that_takes_labels_but_returns_no_loss_is_a_model_like_any_other(models):
    w = usermodel.workload_of(_config(f"{models}:no_loss", 2, {}))
    assert w.targets == "" and w.layer_names == ("body", "out")


@pytest.mark.parametrize("factory, message", [
    ("per_sample", "the loss its forward(..., labels=...) returned must be one number (a tensor: the mean over "
                   "the batch), got shape (4,)"),
    ("detached", "does not depend on its parameters (detached, or computed under no_grad?)"),
    ("both", "its forward() takes 'labels' and returns its own loss, and the factory returned 'loss' too"),
])
def test_a_loss_that_cannot_be_trained_is_refused_in_one_line(models, refused, factory, message):
    refused(["compare", "--model", f"{models}:{factory}", "--input-shape", "3,4,4", "--classes", "5"], message)


def test_the_inference_shortcut_without_targets_is_refused_saying_how_to_take_them(models, refused):
    refused(["compare", "--model", f"{models}:last_only", "--vocab", "64", "--seq-len", "16"],
            "its output (4, 1, 64) does not fit targets (4, 16) of tokens of 64 x 16 (cross-entropy wants (..., "
            "classes) against (...)); a forward that gives the last position's logits alone must take the targets")


@pytest.mark.slow
def test_the_nanogpt_example_runs_through_compare_and_every_strategy_runs_it_or_says_why_not(tmp_path):
    """`compare` on examples/nanogpt.py as a user types it (fp32), strategies the parity test above does not
    run (the gathered logits of data_parallel, Hogwild's workers): each matches `single` (hogwild,
    asynchronous, is not expected to). `--strategies all` (docs/your-model.md: every row matched, 3 min 49 s)
    would run 14; here every one left out at planning says why."""
    out = tmp_path / "run"
    p = in_process("compare", "--model", f"{EXAMPLES / 'nanogpt.py'}:nanogpt", "--vocab", "64", "--seq-len", "16",
                   "--batch-size", "16", "--steps", "2", "--warmup", "1", "--devices", "cpu:2",
                   "--strategies", "single,data_parallel,hogwild",
                   "--out", out)
    assert p.returncode == 0, p.stdout + p.stderr
    results = json.loads((out / "results.json").read_text())
    rows = {r["strategy"]: r["equivalence"]["verdict"] for r in results["rows"]}
    assert rows.pop("single") == "baseline" and rows.pop("hogwild") == "not-expected"
    assert rows == {"data_parallel": "match"}, rows
    config = RunConfig(model=f"{EXAMPLES / 'nanogpt.py'}:nanogpt", devices="cpu:2", **TOKENS).validate()
    run, skipped = strategies.resolve(["all"], config.spec, usermodel.workload_of(config))
    assert {"fsdp_tp", "fsdp_pp", "context_parallel", "torch_cp", "fsdp_cp", "expert_parallel"} <= set(skipped)
    assert all(skipped.values()) and len(run) == 14, skipped
