"""DDP's script under torchrun: 2 gloo processes on loopback (torchrun --standalone picks a free port), each
launch with a timeout; and its options' refusals. DDP through `compare` (with gradient accumulation, its
bytes, the cost model): tests/test_compare.py, whose one comparison serves many checks. The script run
alone, a world of one: tests/test_gpu_paths.py (in process)."""

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)


@pytest.mark.slow
def test_torchrun_script_runs_and_writes_the_same_results(tmp_path):
    out = tmp_path / "script"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "scripts/ddp.py", "--steps", "3", "--batch-size", "32", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert p.returncode == 0, p.stdout + p.stderr
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    assert row["strategy"] == "ddp" and row["world_size"] == 2 and row["devices"] == "cpu:2"
    assert p.stdout.count("Every strategy against") == 1  # only rank 0 prints the table


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--accum", "0"], "--accum must be at least 1, got 0"),
        (["--accum", "3"], "global batch 512 is not divisible by world size 2 x accum 3 = 6"),
        (["--bucket-mb", "-1"], "--bucket-mb must be 0 (torch's default) or more, got -1.0"),
        (["--prescale", "2"], "--prescale must be 0 or 1, got 2"),
        (["--accum", "two"], "invalid comma-separated int value: 'two'"),
    ],
)
def test_bad_ddp_options_are_one_line_exit_2(argv, message, refused):
    refused(["compare", "--strategies", "ddp", "--devices", "cpu:2", *argv], message)
