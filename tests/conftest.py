import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parallel import strategies
from parallel.config import RunConfig
from parallel.judge import equivalence
from parallel.world.dist import Dist

ROOT = Path(__file__).resolve().parents[1]

# The suite's longest modules first (their seconds summed from `--durations=0` on a fresh clone, 2026-12-03:
# 142, 117, 76, 71, 55, 51, 44, 37, 30 and 29 s). `--dist loadfile --no-loadscope-reorder` (launch.sh) hands
# a worker the next module in this order when it finishes one, so the long ones start at once and the short
# ones fill in at the end, instead of one worker running a long module alone while the other waits. (xdist's
# own order, the most tests first, had left one worker alone for the last minute.)
LONGEST_FIRST = ["test_mutants", "test_reliability", "test_docs_commands", "test_sharded", "test_compare",
                 "test_oracle", "test_tensor_parallel", "test_pipeline_dist", "test_hf_corpus", "test_own_loss",
                 "test_experts", "test_multinode", "test_cli", "test_preflight", "test_muon", "test_master"]


def pytest_collection_modifyitems(items):
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.stem, len(first)))  # stable: the rest as collected


def session_alive(sid: int) -> list[int]:
    """Processes still alive in the process session `sid` (a launch started with start_new_session)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # state, ppid, pgrp, session, ...
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


@pytest.fixture
def signals_restored():
    """SIGTERM's and SIGINT's handlers as they were before the test: the commands that stop like Ctrl-C
    (cli._stop_like_ctrl_c) set both in the test's own process."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    yield
    for s, handler in before.items():
        signal.signal(s, handler)


@pytest.fixture
def small():
    """A validated config small enough to train in well under a second."""

    def make(**kw) -> RunConfig:
        base = {"workload": "cnn", "batch_size": 32, "steps": 4, "warmup": 1, "devices": "cpu:2"}
        return RunConfig(**{**base, **kw}).validate()

    return make


def judged(name: str, config: RunConfig):
    """(row, the oracle's verdict) of an in-process strategy against `single` on the same config."""
    from parallel.worker import execute

    strategy = strategies.get(name)
    row, state = execute(strategy, config, Dist())
    ref = equivalence.reference_of(config, *execute(strategies.get("single"), config, Dist()))
    return row, equivalence.judge(strategy, config, ref, row, state)


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def in_process(*args) -> subprocess.CompletedProcess:
    """`python -m parallel ARGS` run in this process: its exit code and what it printed, without a new
    interpreter (importing torch and starting a zygote: about 10 s of CPU a call here). For what a command
    does; how its process ends (a signal, Ctrl-C) is tested in a process of its own."""
    from parallel import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main([str(a) for a in args])
    return subprocess.CompletedProcess(["python", "-m", "parallel", *args], code, out.getvalue(), err.getvalue())


def python() -> str:
    return sys.executable


@pytest.fixture
def refused(tmp_path, capsys):
    """refused(argv, message): `python -m parallel argv --out X` is bad input: exit 2, exactly one line
    on stderr containing `message`, and nothing written (X not even created)."""
    from parallel import cli

    def check(argv: list[str], message: str) -> None:
        out = tmp_path / "refused-out"
        try:
            code = cli.main([*argv, "--out", str(out)])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and message in err[0], err
        assert not out.exists()

    return check


@pytest.fixture
def strict_cuda(monkeypatch):
    """A machine with two GPUs, as far as the package can tell: parallel.world.devices.CUDA replaced by a strict
    stand-in that enforces CUDA's rules and logs every call (tests/strict_cuda.py)."""
    from parallel.world import devices, machine
    from tests.strict_cuda import StrictCuda

    fake = StrictCuda(count=2)
    monkeypatch.setattr(devices, "CUDA", fake)
    # Its GPUs exist in this process only: the child process that asks CUDA for their names (where NVML does
    # not load) would find none, after 2 s of starting an interpreter and torch here.
    monkeypatch.setattr(machine, "_child_cuda_info", lambda: [])
    return fake


@pytest.fixture
def no_cuda(monkeypatch):
    """A machine with no GPU, as far as the package can tell, whatever this one has: for the tests of what
    `auto` means without GPUs (the package asks parallel.world.devices.CUDA, never torch.cuda, for its devices)."""
    from parallel.world import devices
    from tests.strict_cuda import StrictCuda

    monkeypatch.setattr(devices, "CUDA", StrictCuda(count=0))


@pytest.fixture(autouse=True, scope="session")
def _as_if_gpus():
    """PARALLEL_TEST_AS_IF_GPUS=N pytest ...: every test sees N GPUs through the strict stand-in, as on a GPU
    machine. An audit for machines without one: a test that fails only under it assumes the machine it runs
    on (auto devices, no GPU), or reaches CUDA for real, which the stand-in cannot do (read its error)."""
    count = os.environ.get("PARALLEL_TEST_AS_IF_GPUS")
    if not count:
        yield
        return
    from parallel.world import devices
    from tests.strict_cuda import StrictCuda

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(devices, "CUDA", StrictCuda(count=int(count)))
        yield
