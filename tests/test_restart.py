"""torchrun restarts recover when torchrun is typed by hand: `torchrun --standalone ... scripts/ddp.py`
(the README's line), with torch's default store sharing. On torch 2.13 a restarted group otherwise reads
the failed attempt's keys from the agent's store and cannot meet (see Dist._store). No process is left.
The same launch is the test of DDP's script under torchrun (its results, rank 0's one table). The harness's
path is in test_reliability.py, `launch.sh multinode`'s (two agents) in test_multinode.py."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from parallel.config import RunConfig
from tests.conftest import ROOT, session_alive
from tests.multirank import uninterrupted

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def torchrun(out, *extra: str) -> str:
    """The issue's command line; torch's default store sharing whatever the caller's environment says."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--max-restarts=1",
           "scripts/ddp.py", "--steps", "10", "--warmup", "0", "--batch-size", "64", *extra, "--out", str(out)]
    p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"},
                         start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = p.communicate(timeout=200)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 0, log[-3000:]
    assert session_alive(p.pid) == [], "a process of the launch outlived it"
    return log


def test_a_hand_typed_torchrun_restarts_a_failed_rank_and_ends_like_an_uninterrupted_run(tmp_path):
    # No checkpoint here: the restarted attempt trains from step 0, on the same batches.
    log = torchrun(tmp_path / "crashed", "--fail-at-step", "5", "--fail-rank", "1")
    assert "InjectedFault: injected fault at step 5 on rank 1" in log  # it did fail, and recovered
    (row,) = json.loads((tmp_path / "crashed" / "results.json").read_text())["rows"]
    assert row["strategy"] == "ddp" and row["world_size"] == 2 and row["devices"] == "cpu:2"
    assert log.count("Every strategy against") == 1  # only rank 0 prints the table, once, at the end
    config = RunConfig(devices="cpu:2", steps=10, warmup=0, batch_size=64).validate()  # the script's run
    loss, clean = uninterrupted("ddp", config)
    assert row["final_loss"] == loss
    crashed = torch.load(tmp_path / "crashed" / "ddp_final.pt", weights_only=True)
    assert crashed.keys() == clean.keys() and all(torch.equal(crashed[k], clean[k]) for k in clean)
