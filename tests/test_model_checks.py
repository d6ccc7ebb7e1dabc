"""Issues 60 and 71: a user's model never crashes the comparison, and our own bugs are never blamed on it.
Tensors reach its forward as a DataLoader hands them (contiguous); a strategy's check that the meta device
refuses runs again on a real copy; one that fails on both in the model's code is a one-line skip, even
where the user named the strategy, and one that fails in ours an error when named (exit 2); an error the
user's code raises is one line naming their file and line, and one raised in ours an internal error."""

import dataclasses
import operator

import pytest
import torch
from torch import nn

from parallel import cli, strategies
from parallel.compare import select_runs
from parallel.config import RunConfig
from parallel.models import outputs
from parallel.models.usermodel import shape_model
from parallel.report import notes
from parallel.world.errors import REPORT, CheckBroken, CheckFailed
from tests.conftest import ROOT
from tests.test_report import row as report_row

NANOGPT = f"{ROOT / 'examples' / 'nanogpt_as_written.py'}:gpt"


def config() -> RunConfig:
    return RunConfig(model=NANOGPT, devices="cpu:2", vocab=64, seq_len=16, batch_size=8, steps=1).validate()


class Views(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(8, 8)

    def forward(self, x, targets=None):
        return self.embed(x.view(-1)), targets.view(-1)  # as nanoGPT's loss does: raises on a strided tensor


def test_what_a_forward_is_handed_is_contiguous_as_a_loaders_is():
    chain = torch.arange(40).reshape(4, 10) % 8
    x, y = chain[:, :-1], chain[:, 1:]  # the held-out set was cut so: views a .view refuses
    assert not y.is_contiguous()
    model = Views()
    model._parallel_targets = "targets"  # as usermodel records a forward that takes its targets
    _, seen = outputs.call(model, x, y)
    assert torch.equal(seen, y.reshape(-1))


def test_a_check_the_meta_device_refuses_runs_again_on_a_real_copy(monkeypatch):
    ddp = strategies.get("ddp")
    seen = []

    def grouped_mm_like(cfg):  # the experts' grouped_mm refuses fp32 on the meta device (Mixtral, Qwen2-MoE)
        meta = next(shape_model(cfg).parameters()).is_meta
        seen.append(meta)
        if meta:
            raise RuntimeError("Expected inputs of BF16 type but got mat_a.dtype=torch.float32")

    monkeypatch.setattr(ddp, "check", grouped_mm_like)
    why = "RuntimeError: Expected inputs of BF16 type but got mat_a.dtype=torch.float32"
    assert ddp.validate(config()) == why and seen == [True, False]  # why the copy was used, for the report
    monkeypatch.setattr(strategies, "get", lambda name, get=strategies.get: ddp if name == "ddp" else get(name))
    chosen, _ = select_runs(config(), ["single", "ddp"])
    assert [cfg.real_copy for _, _, cfg in chosen] == ["", why]  # the row's details, then the notes, say it
    row = dataclasses.replace(report_row("ddp", 1.0), details={"checked_on_a_real_copy": why})
    assert f"ddp: checked on a real copy of the model in the parent, where the meta device refused ({why})" in \
        notes.notes([row], {"device_kind": "real"})


def failing_with(monkeypatch, fails, names=("ddp",)):
    """strategies.get, with the check of the strategies `names` replaced by `fails`."""
    made, get = {}, strategies.get

    def failing(name):
        if name not in made:
            made[name] = get(name)
            made[name].check = fails
        return made[name]

    monkeypatch.setattr(strategies, "get", lambda name: failing(name) if name in names else get(name))


def test_a_check_the_model_fails_on_both_is_one_line_and_a_skip_even_when_named(monkeypatch):
    def fails(cfg):  # stands for the model's own code (a file of the user's: this one), raising in our check
        raise RuntimeError("a kernel's long message\nNotImplementedError: aten::equal on Meta")

    failing_with(monkeypatch, fails)
    chosen, skipped = select_runs(config(), ["single", "ddp"])
    assert [s.name for s, _, _ in chosen] == ["single"]
    line = fails.__code__.co_firstlineno + 1
    assert skipped["ddp"] == (f"ddp: its check of --model {NANOGPT} failed on the meta device (RuntimeError: "
                              "NotImplementedError: aten::equal on Meta) and on a real copy (RuntimeError: "
                              f"NotImplementedError: aten::equal on Meta, raised by the model at {__file__}:{line})")
    failing_with(monkeypatch, fails, ("single", "ddp"))  # the baseline cannot run either: raised (exit 1, one line)
    with pytest.raises(CheckFailed, match="^single: its check of --model"):
        select_runs(config(), ["single", "ddp"])


def test_a_check_broken_in_our_own_code_is_an_error_when_named_and_a_said_skip_under_all(monkeypatch, refused):
    broken = operator.itemgetter("seq_len")  # a bug of ours: raised inside parallel's own frame (_checked)
    failing_with(monkeypatch, broken)
    with pytest.raises(CheckBroken, match="raised in parallel's check, not in the model: this is a bug in parallel"):
        select_runs(config(), ["single", "ddp"])
    refused(["compare", "--model", NANOGPT, "--vocab", "64", "--seq-len", "16", "--strategies", "single,ddp"],
            "ddp: its check of --model")  # exit 2, both errors in one line, nothing written
    chosen, skipped = select_runs(config(), ["all"])
    assert "ddp" not in {s.name for s, _, _ in chosen} and "not in the model" in skipped["ddp"], skipped


def test_an_error_the_users_code_raises_is_theirs_in_one_line_naming_their_file_and_line(monkeypatch, capsys,
                                                                                        tmp_path):
    def raises(*args, **kwargs):  # stands for the user's code (a file outside the package): this one
        raise ValueError("first words\nzip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(cli, "select_runs", raises)
    code = cli.main(["compare", "--model", NANOGPT, "--vocab", "64", "--seq-len", "16", "--out", str(tmp_path)])
    line = raises.__code__.co_firstlineno + 1
    assert code == 1 and capsys.readouterr().err == (f"error: --model {NANOGPT}: your code raised ValueError: first "
                                                     f"words at {__file__}:{line}\n")


def test_a_model_that_raises_in_its_forward_is_named_at_its_file_and_line(tmp_path, refused):
    (tmp_path / "m.py").write_text("from torch import nn\n\n\nclass M(nn.Linear):\n    def forward(self, x):\n"
                                   "        raise ValueError('no mask for these')\n\n\ndef m():\n    return M(4, 2)\n")
    refused(["compare", "--model", f"{tmp_path / 'm.py'}:m", "--input-shape", "4", "--classes", "2"],
            f"ValueError: no mask for these (at {tmp_path / 'm.py'}:6)")


def test_a_fault_in_our_own_reporting_code_is_an_internal_error_with_its_traceback(monkeypatch, capsys, tmp_path):
    """Not the user's, though the run was of a user's model: never put on --model. The traceback, then one
    line, exit 3. The report of a finished comparison drawn again (`report OUT`: the same code as compare's)."""
    import shutil

    from parallel.report import notes

    shutil.copy(ROOT / "tests" / "data" / "compare_cpu2.json", tmp_path / "results.json")  # a real compare
    monkeypatch.setattr(notes, "skipped_line", operator.itemgetter("skipped"))  # a KeyError in our notes
    code = cli.main(["report", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 3 and err[0] == "Traceback (most recent call last):" and "report/notes.py" in "\n".join(err), err
    assert err[-1] == f"internal error: KeyError: 'skipped': {REPORT}"
    monkeypatch.setattr(cli, "select_runs", notes.first_steps)  # called wrongly by our compare: with --model too
    assert cli.main(["compare", "--model", NANOGPT, "--vocab", "64", "--seq-len", "16", "--out", str(tmp_path / "o")]) \
        == 3 and "--model" not in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.slow
def test_a_model_that_raises_in_a_strategys_step_fails_its_row_naming_its_file_and_line(tmp_path):
    """Past the parent's checks (its first calls pass), the model raises inside a child: in-process and
    under torchrun, the row's error names the user's file and line."""
    from parallel.compare import run_strategies

    (tmp_path / "later.py").write_text("from torch import nn\n\n\nclass M(nn.Linear):\n    calls = 0\n\n"
                                       "    def forward(self, x):\n        self.calls += 1\n"
                                       "        if self.calls > 3:\n            raise ValueError('stale cache')\n"
                                       "        return super().forward(x)\n\n\ndef m():\n    return M(4, 2)\n")
    c = RunConfig(model=f"{tmp_path / 'later.py'}:m", input_shape="4", classes=2, devices="cpu:2", batch_size=8,
                  steps=3, warmup=1, out=str(tmp_path / "out")).validate()
    chosen, _ = select_runs(c, ["single", "ddp"])
    for row in run_strategies(c, chosen):
        assert row.status == "failed" and f"ValueError: stale cache (at {tmp_path / 'later.py'}:10)" in row.error, \
            (row.strategy, row.error)


def test_torchs_layers_and_installed_libraries_are_never_the_users_code(tmp_path):
    """A model made of torch's layers is no file of the user's; a frame in any site-packages folder is a
    library's, whoever called it decides; a frame of this package deeper than the user's makes it ours."""
    from parallel.world.errors import raised_in

    assert outputs.model_files(nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))) == set()
    assert outputs.model_files(Views()) == {__file__}
    library = {}
    exec(compile("def lib(f):\n    f()\n", str(tmp_path / "site-packages" / "lib.py"), "exec"), library)

    def theirs():
        raise ValueError("theirs")

    try:
        library["lib"](theirs)
    except ValueError as e:
        assert raised_in(e) == f"{__file__}:{theirs.__code__.co_firstlineno + 1}"  # the library frame skipped
    try:
        library["lib"](lambda: select_runs(None, []))  # our code raises, called through a library
    except AttributeError as e:
        assert raised_in(e) == ""
