"""Issue 60: every `compare --model ...` command README.md and docs/your-model.md show runs as a user types it,
through the same parent (`python -m parallel compare`, in this process): the arguments, the data, every
strategy's checks on the model, the baseline trained and evaluated on the held-out set (where non-contiguous
targets once crashed a model's `.view`), the report. The other rows' training is left to the parity tests
(tests/test_oracle.py, tests/test_hf_corpus.py): here the baseline alone trains, 2 steps, to keep the suite
in its budget; `python -m parallel.tools.docs_commands` runs each whole (docs/measurements.md). A command
naming a file the repository does not hold (my_model.py) is the reader's own."""

import dataclasses
import shlex

import pytest

from parallel import cli
from parallel.tools.docs_commands import commands
from tests.conftest import ROOT


def test_the_docs_show_commands_this_test_runs():
    assert len(commands(ROOT)) >= 5 and any("hf_gpt2" in c for c in commands(ROOT)), commands(ROOT)


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("line", commands(ROOT))
def test_every_compare_model_command_the_docs_show_runs_as_written(line, tmp_path, monkeypatch, capsys):
    real = cli.select_runs

    def baseline_only(config, names, baseline=True, **kwargs):  # every check on every strategy; the baseline trains
        chosen, skipped = real(config, names, baseline, **kwargs)
        skipped |= {s.name: "not trained in this test" for s, _, _ in chosen[1:]}
        return [(s, label, dataclasses.replace(cfg, steps=2, warmup=0)) for s, label, cfg in chosen[:1]], skipped

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(cli, "select_runs", baseline_only)
    code = cli.main([*shlex.split(line), "--out", str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0 and "Traceback" not in out.out + out.err, out.err[-2000:]
