"""`python -m parallel preflight` on this machine: every strategy, the GPU basics and a torchrun restart
pass on the CPU, and the CUDA checks are listed as not run, each with its reason."""

import json

import pytest

from parallel import cli


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_preflight_passes_here_and_lists_what_needs_a_gpu(tmp_path, capsys):
    # `single` alone, to keep the suite short (every launch has its own module's tests; a torchrun group
    # runs here in the restart check); `./launch.sh preflight` runs them all. On three devices, which
    # refused the whole preflight before (a batch of 64 does not divide by 3): now 63 (#28; the pipelines'
    # micro-batches fitted to it: tests/test_planning.py).
    names = ["single"]
    assert cli.main(["preflight", "--devices", "cpu:3", "--strategies", ",".join(names), "--out", str(tmp_path)]) == 0
    checks = json.loads((tmp_path / "preflight.json").read_text())["checks"]
    by_status = {s: [c["name"] for c in checks if c["status"] == s] for s in ("passed", "failed", "not run")}
    assert by_status["failed"] == []
    assert {f"{n} on cpu:3" for n in names} <= set(by_status["passed"])
    assert {"torchrun restart after a failed rank", "bench cpu-vs-gpu", "bench memory", "devices"} <= \
        set(by_status["passed"])
    assert "bench streams" in by_status["not run"] and "strategies on GPUs (nccl)" in by_status["not run"]
    assert all(c["detail"] for c in checks if c["status"] == "not run")  # each says why
    out = capsys.readouterr().out
    assert all(c["name"] in out for c in checks)  # one line per check on the terminal


def test_preflight_refuses_bad_input(refused):
    refused(["preflight", "--devices", "cpu:0"], "the virtual device count must be 1..64, got 0")
    refused(["preflight", "--workload", "nosuch"], "unknown workload 'nosuch'")
    refused(["preflight", "--strategies", "nosuch"], "unknown strategy 'nosuch'")
