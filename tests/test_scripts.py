"""Every strategy is also a script launched the standard way, `scripts/<name>.py`: the same few lines for
each, calling `cli.script_main(name)`. So a launch of each kind proves the path from a plain clone (a
torchrun worker: test_ddp.py; a plain process: test_cli.py's single), and each script's own strategy runs
here, in process, through that same script_main (a child process would add 5-10 s of imports each)."""

import hashlib
import json

import pytest

from parallel import cli, strategies
from tests.conftest import ROOT


def _body(name: str) -> str:
    """A script without its docstring, its strategy's name taken out."""
    return (ROOT / "scripts" / f"{name}.py").read_text().split('"""', 2)[2].replace(f'"{name}"', '"NAME"')


def test_every_strategy_has_a_script_and_every_script_is_the_same_lines():
    names = {s.name for s in strategies.all_strategies()}
    assert {p.stem for p in (ROOT / "scripts").glob("*.py")} == names
    assert len({hashlib.sha256(_body(n).encode()).hexdigest() for n in names}) == 1
    assert 'raise SystemExit(script_main("NAME"))' in _body("ddp")


@pytest.mark.parametrize("name, shown", [("manual_dp", "manual_dp"), ("data_parallel", "data_parallel"),
                                         ("model_parallel", "Pipelines: idle and step"),
                                         ("pipeline", "Pipelines: idle and step"), ("hogwild", "hogwild")])
def test_a_script_runs_its_strategy_and_writes_its_row(name, shown, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["--steps", "2", "--batch-size", "32", "--devices", "cpu:2", "--out", str(out)]
    assert cli.script_main(name, args + (["--workers", "2"] if name == "hogwild" else [])) == 0
    assert shown in capsys.readouterr().out
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["strategy"] == name and row["status"] == "ok" and row["equivalence"]["verdict"] == "unchecked"
    if name == "hogwild":  # its workers ran (the fork server's), and their staleness is reported
        assert row["launcher"] == "hogwild" and row["samples_per_s"] > 0 and "staleness_p95" in row["details"]
