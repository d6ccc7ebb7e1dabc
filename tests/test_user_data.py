"""Issue 71: users' data as it comes. Targets of -100 (Hugging Face's padding) pass every check and make the
loss the global token mean; a token file (.bin as nanoGPT writes it, .npy) is memory-mapped, each rank reading
its own rows, the step's count of real targets all-reduced once; a file that cannot serve the run is one line."""

import os
import resource
import runpy

import numpy as np
import pytest
import torch

from parallel.config import RunConfig
from parallel.loop import tokens
from parallel.loop.tokens import TokenMean, loss_of
from parallel.models.data import FILE, IGNORE, PAD
from parallel.models.usermodel import workload_of
from parallel.world.dist import Dist
from tests.conftest import ROOT
from tests.multirank import _train, judged_on_ranks, run_ranks

MAKE = runpy.run_path(str(ROOT / "examples" / "make_data.py"))
PADDED_NPY = ROOT / "examples" / "data" / "padded_tokens.npy"  # make_data.py npy --tokens 4096
LLAMA = f"{ROOT / 'examples' / 'hf_llama.py'}:llama"

LM = """
import torch
from torch import nn


class LM(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 16), nn.Linear(16, vocab)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)))


class OwnMean(LM):  # its own mean loss, not plain cross-entropy (label smoothing): the harness cannot weigh it
    def forward(self, x, targets=None):
        logits = super().forward(x)
        return logits, nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=0.1)


def lm(vocab: int = 64, seq_len: int = 8):
    return LM(vocab)


def own_mean(vocab: int = 64, seq_len: int = 8):
    return OwnMean(vocab)
"""


@pytest.fixture
def lm(tmp_path):
    (tmp_path / "lm.py").write_text(LM)
    return str(tmp_path / "lm.py")


def padded_pt(path, padding="first", samples=256, vocab=64, seq_len=8):
    torch.save(MAKE["padded"](samples, vocab, seq_len, padding, 0), path)
    return str(path)


@pytest.mark.parametrize("padding", ["first", "later"])
def test_minus_100_targets_pass_every_check_and_weigh_the_global_token_mean(tmp_path, lm, padding):
    data = padded_pt(tmp_path / "padded.pt", padding)
    config = RunConfig(model=f"{lm}:lm", data=data, batch_size=32, devices="cpu:2").validate()
    workload = workload_of(config)
    assert workload.tokens == FILE and isinstance(loss_of(workload), TokenMean)
    data = workload.dataset(0, 32)
    for step in range(8):  # the first half of the samples padded, or the second: some steps even
        y = data.batch(step)[1]
        assert data.density(step) == (y != IGNORE).sum().item() / y.numel()


def test_the_note_gives_a_shares_least_and_most_real_tokens_and_a_models_own_mean_is_named(tmp_path, lm):
    from parallel.report import notes, overview

    data = padded_pt(tmp_path / "padded.pt", "every")
    for factory, own in (("lm", False), ("own_mean", True)):
        config = RunConfig(model=f"{lm}:{factory}", data=data, batch_size=32, steps=2, warmup=1,
                           devices="cpu:2").validate()
        facts = overview.run_facts(config)
        shares = [int((workload_of(config).dataset(0, 32).batch(step, r, 2)[1] != IGNORE).sum())
                  for step in range(3) for r in range(2)]
        assert facts["real_tokens_per_share"] == [min(shares), max(shares)] and facts["own_mean_loss"] is own
        line = next(n for n in notes.notes([], {"run": facts, "device_kind": "real"}) if n.startswith("uneven"))
        assert line.startswith(f"uneven tokens (--data's -100 targets): a 1/2 share of a batch held {min(shares)} "
                               f"to {max(shares)} real tokens") and ("cannot weigh" in line) is own, line


def test_two_runs_of_one_model_on_other_data_are_two_workloads(tmp_path, lm):
    """Caches keyed by the workload (the held-out set, the teacher's samples) must not hand one run's data
    to another in the same process."""
    a, b = padded_pt(tmp_path / "a.pt", "first"), padded_pt(tmp_path / "b.pt", "later")
    on = [workload_of(RunConfig(model=f"{lm}:lm", data=d, batch_size=32).validate()) for d in (a, b, a)]
    assert on[0] != on[1] and on[0] == on[2] and hash(on[0]) == hash(on[2])


def test_a_file_with_no_ignored_target_is_trained_as_it_was(tmp_path, lm):
    even = MAKE["padded"](64, 64, 8, "every", 0)
    torch.save({"x": even["x"], "y": even["y"].clamp(min=0)}, tmp_path / "even.pt")
    workload = workload_of(RunConfig(model=f"{lm}:lm", data=str(tmp_path / "even.pt"), batch_size=16).validate())
    assert workload.tokens == "even" and not isinstance(loss_of(workload), TokenMean)


def token_workload(data, vocab=256, seq_len=32, batch_size=16, model=None):
    return workload_of(RunConfig(model=model or LLAMA, data=str(data), vocab=vocab, seq_len=seq_len,
                                 batch_size=batch_size, devices="cpu:2").validate())


def test_a_token_file_is_cut_as_megatron_cuts_it_each_rank_reading_its_rows(tmp_path, lm):
    flat = MAKE["flat"](5000, 64, 0)  # uint16, as nanoGPT's prepare.py writes train.bin
    flat.tofile(tmp_path / "train.bin")
    data = token_workload(tmp_path / "train.bin", 64, 8, model=f"{lm}:lm").dataset(0, 16)
    x, y = data.batch(3)
    first = 3 * 16
    assert torch.equal(x[0], torch.from_numpy(flat[first * 8:first * 8 + 8].astype(np.int64)))
    assert torch.equal(y[0], torch.from_numpy(flat[first * 8 + 1:first * 8 + 9].astype(np.int64)))
    assert all(torch.equal(torch.cat([data.batch(3, r, 4)[i] for r in range(4)]), (x, y)[i]) for i in (0, 1))
    held_x, _ = data.heldout()
    assert len(held_x) == min(2048, data.n // 8) and data.train + len(held_x) == data.n  # never trained on
    step = data.train // 16 + 1  # past the training sequences: they come round again, as epochs
    i = step * 16 % data.train
    assert torch.equal(data.batch(step)[0][0], torch.from_numpy(flat[i * 8:i * 8 + 8].astype(np.int64)))


def test_a_signed_token_files_minus_100_is_padding_in_and_no_target_out():
    data = token_workload(PADDED_NPY).dataset(0, 16)
    flat = np.load(PADDED_NPY)
    x, y = data.batch(0)
    seq = torch.from_numpy(flat[: 16 * 32 + 1].astype(np.int64))
    assert torch.equal(y.reshape(-1)[:100], seq[1:101])
    assert torch.equal(x.reshape(-1)[:100], seq[:100].masked_fill(seq[:100] == IGNORE, PAD))
    assert data.density(0) == (y != IGNORE).float().mean().item() < 1


def _count(rank, world):  # each rank its own rows (2 shares), or both ranks the same rows (1, as tp ranks)
    data = token_workload(PADDED_NPY).dataset(0, 16)
    dist = Dist(rank=rank, local_rank=rank, world_size=world, local_world_size=world)
    calls, out = [], {}
    reduce = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), reduce(t, *a, **k))[1]
    try:
        for shares in (2, 1):
            out[shares] = [tokens.density(data, step, data.batch(step, rank * shares // world, shares)[1], shares,
                                          dist) for step in range(6)]
    finally:
        torch.distributed.all_reduce = reduce
    return out, [data.density(step) for step in range(6)], calls


def test_the_count_all_reduced_from_each_ranks_rows_is_the_whole_steps():
    for counted, whole, calls in run_ranks(_count, 2):
        assert counted == {2: whole, 1: whole} and calls == [1] * 12  # one all-reduce of one number a step


def test_a_token_file_larger_than_memory_is_read_a_batch_at_a_time(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:  # 40 GiB of token 0, sparse: more than this machine's 24 GiB of memory
        f.truncate(40 * 2**30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    data = token_workload(big).dataset(0, 16)
    x, y = data.batch(10**8)  # a step far into the file
    assert x.shape == (16, 32) and data.n == (40 * 2**29 - 1) // 32
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 256 * 1024  # KiB: nothing read whole
    os.remove(big)


@pytest.fixture
def token_files(tmp_path):
    np.zeros(40, dtype=np.uint16).tofile(tmp_path / "short.bin")
    np.save(tmp_path / "float.npy", np.zeros(4096, dtype=np.float32))
    np.save(tmp_path / "square.npy", np.zeros((64, 64), dtype=np.int32))
    (tmp_path / "odd.bin").write_bytes(b"\0" * 4097)
    np.arange(1, 4097, dtype=np.int32).tofile(tmp_path / "int32.bin")  # int32 written where uint16 is read
    np.full(4096, 300, dtype=np.uint16).tofile(tmp_path / "wide.bin")
    return tmp_path


@pytest.mark.parametrize("argv, message", [
    (["--data", "{d}/short.bin", "--vocab", "256", "--seq-len", "32"], "40 tokens make 1 sequences of 32"),
    (["--data", "{d}/float.npy", "--vocab", "256", "--seq-len", "32"], "holds float32; token ids are"),
    (["--data", "{d}/square.npy", "--vocab", "256", "--seq-len", "32"], "a token file is one flat array"),
    (["--data", "{d}/odd.bin", "--vocab", "256", "--seq-len", "32"], "not a whole number of uint16 tokens"),
    (["--data", "{d}/int32.bin", "--vocab", "8192", "--seq-len", "32"], "as int32 tokens read as uint16 are"),
    (["--data", "{d}/wide.bin", "--vocab", "256", "--seq-len", "32"], "token 300 at position 0 is outside --vocab"),
    (["--data", "{d}/wide.bin"], "give --vocab (at least 2) and --seq-len"),
    (["--data", "{d}/wide.bin", "--vocab", "512", "--seq-len", "32", "--tokens", "padded"], "brings its own targets"),
])
def test_a_token_file_that_cannot_serve_the_run_is_one_line(argv, message, token_files, refused):
    refused(["compare", "--model", LLAMA, "--batch-size", "16", *[a.format(d=token_files) for a in argv]], message)


@pytest.mark.slow
def test_every_collective_strategy_matches_one_device_on_a_users_padded_data(tmp_path):
    """Each rank its own rows of a token file with -100 padding, the count all-reduced (ddp, tensor_parallel,
    pipeline_dist); a .pt with the padding in its first samples (ddp) and one with it later (pipeline_dist):
    in fp64 against `single`, every replica agreeing at every step. The matrix (every strategy, cpu:2 and
    cpu:4) is in docs/your-model.md#your-data."""
    torch.save(MAKE["padded"](256, 256, 32, "later", 0), tmp_path / "later.pt")
    runs = [(name, str(PADDED_NPY), {}) for name in ("ddp", "tensor_parallel", "pipeline_dist")]
    runs += [("ddp", str(ROOT / "examples" / "data" / "padded.pt"), {}),
             ("pipeline_dist", str(tmp_path / "later.pt"), {})]
    judged_on_ranks(2, runs, _file_config)


@pytest.mark.slow
def test_a_token_file_read_per_rank_trains_bitwise_as_the_same_tokens_held_whole(tmp_path):
    """The same sequences two ways: the token file, each rank reading its rows and all-reducing the count,
    and a .pt of them, every rank holding them all and counting the step itself. ddp's parameters equal."""
    data = token_workload(PADDED_NPY).dataset(0, 16)
    x, y = data._rows(np.arange(data.n))
    torch.save({"x": x, "y": y}, tmp_path / "same.pt")
    runs = [("ddp", str(PADDED_NPY), {}), ("ddp", str(tmp_path / "same.pt"), {})]
    (_, file_state), (_, whole_state) = run_ranks(_train, 2, (runs, _file_config), timeout=150)[0]
    assert file_state.keys() == whole_state.keys() and all(torch.equal(file_state[k], whole_state[k])
                                                           for k in file_state)


def test_a_models_own_loss_that_cannot_take_minus_100_is_told_what_it_needs(refused):
    """nanoGPT's loss ignores -1, not -100: one line naming its file and line, and the convention it needs."""
    refused(["compare", "--model", f"{ROOT / 'examples' / 'nanogpt_as_written.py'}:gpt", "--data",
             str(ROOT / "examples" / "data" / "padded.pt"), "--batch-size", "32"],
            "nanogpt_as_written.py:111); its own loss is handed targets of -100")


def _file_config(data: str, world: int, options: dict) -> RunConfig:  # judged_on_ranks imports it
    sizes = {"vocab": 256, "seq_len": 32}
    return RunConfig(model=LLAMA, data=data, batch_size=16, steps=2, warmup=1, devices=f"cpu:{world}",
                     options=options, check_replicas=True, **sizes).validate()
