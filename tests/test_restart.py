"""torchrun restarts recover on every launch path, not only the harness's: a hand-typed
`torchrun --standalone ... scripts/ddp.py` (the README's line) and `launch.sh multinode` with two agents
on loopback (what scripts/slurm/ddp.sbatch runs). On torch 2.13 a restarted group otherwise reads the
failed attempt's keys from the agent's store and cannot meet (see Dist._store). No process is left."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel.harness.launch import LoopbackStore
from tests.conftest import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
TRAIN = ["--steps", "10", "--warmup", "0", "--batch-size", "64"]
FAULT = ["--fail-at-step", "5", "--fail-rank", "1"]


def _session_alive(sid: int) -> list[int]:
    """Processes still alive in the process session `sid` (a launch started with start_new_session)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
            alive.append(int(stat.parent.name))
    return alive


def _run(cmds: list[list[str]], env: dict | None = None) -> list[tuple[int, str]]:
    """Start every command at once (each its own session), wait for all; check none leaves a process."""
    procs = [subprocess.Popen(c, cwd=ROOT, env={**os.environ, **(env or {})}, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=200)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        assert _session_alive(p.pid) == [], "a process of the launch outlived it"
    return [(p.returncode, log) for p, log in zip(procs, logs, strict=True)]


def _final(out: Path) -> tuple[float, dict]:
    (row,) = json.loads((out / "results.json").read_text())["rows"]
    return row["final_loss"], torch.load(out / "ddp_final.pt", weights_only=True)


def test_a_hand_typed_torchrun_restarts_a_failed_rank_and_ends_like_an_uninterrupted_run(tmp_path):
    # The command: no store variable, no checkpoint: the restarted attempt trains from step 0.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=1", "scripts/ddp.py", *TRAIN]
    env = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}  # torch's default, whatever the caller's environment
    [(crashed_rc, crashed_log)] = _run([[*torchrun, *FAULT, "--out", str(tmp_path / "crashed")]], env)
    assert crashed_rc == 0, crashed_log[-3000:]
    assert "InjectedFault: injected fault at step 5 on rank 1" in crashed_log  # it did fail, and recovered
    [(clean_rc, _)] = _run([[*torchrun, "--out", str(tmp_path / "clean")]], env)
    assert clean_rc == 0
    (loss_a, state_a), (loss_b, state_b) = _final(tmp_path / "crashed"), _final(tmp_path / "clean")
    assert loss_a == loss_b
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_b)


def _agents(out: Path, extra: list[str]) -> list[tuple[int, str]]:
    store = LoopbackStore(0, timeout_s=120)
    try:
        cmd = ["bash", "launch.sh", "multinode", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf=is_host=false", "--local-addr=127.0.0.1",
               "--max-restarts=1", "ddp", "--devices", "cpu:2", *TRAIN, "--checkpoint-every", "2", "--resume",
               *extra, "--out", str(out)]
        return _run([cmd, cmd], env={"VENV": sys.prefix, "PARALLEL_NO_SETUP": "1"})
    finally:
        store.close()


def test_two_agents_of_launch_sh_multinode_restart_resume_and_end_bitwise_equal(tmp_path):
    # Rank 1 (the second agent's worker) fails at step 5; both agents restart their workers, which resume
    # from the checkpoint of step 3 and recompute steps 4-9 on the same batches.
    crashed = _agents(tmp_path / "crashed", FAULT)
    assert all(rc == 0 for rc, _ in crashed), "\n".join(log[-2000:] for _, log in crashed)
    assert any("InjectedFault" in log for _, log in crashed)
    assert all(rc == 0 for rc, _ in _agents(tmp_path / "clean", []))
    (loss_a, state_a), (loss_b, state_b) = _final(tmp_path / "crashed"), _final(tmp_path / "clean")
    assert loss_a == loss_b
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_b)
