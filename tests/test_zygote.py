"""harness/zygote.py: a child forked from the zygote is what launch.run_child's Popen made, only sooner: its
own session, the environment and arguments given, its output in the log, its exit code, and ended with
whatever it started by a kill of its group (launch._kill_group), a timeout included."""

import os
import signal
import subprocess
import sys
import time

import pytest

from parallel.harness import launch, zygote

pytestmark = pytest.mark.timeout(120)
SCRIPT = """import os, sys, time
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "session", os.getsid(0) == os.getpid())
if sys.argv[1] == "sleep":
    time.sleep(60)
raise SystemExit(int(sys.argv[1]))
"""


@pytest.fixture
def module(tmp_path, monkeypatch):
    (tmp_path / "zygote_probe.py").write_text(SCRIPT)
    # The zygote started elsewhere first (as by any earlier comparison in this process): the child must
    # still run in the caller's folder with the caller's PYTHONPATH, and find its module there.
    assert zygote.popen([sys.executable, "-m", "json.tool", "--help"], dict(os.environ), os.devnull).wait(60) == 0
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return [sys.executable, "-m", "zygote_probe"]


def test_a_forked_child_gets_its_arguments_environment_session_log_and_exit_code(module, tmp_path):
    log = tmp_path / "child.log"
    outcome = launch.run_child([*module, "3"], 60, log, env={"ZYGOTE_TEST": "yes"}, fork=True)
    assert outcome.returncode == 3 and not outcome.timed_out
    assert log.read_text().splitlines()[0] == "argv ['3'] env yes session True"
    assert launch.run_child([*module, "0"], 60, log, fork=True).returncode == 0
    assert zygote.popen(["python3", "-c", "pass"], {}, str(log)) is None  # not `-m`: started the usual way


def test_a_forked_child_over_its_timeout_is_ended_with_its_group(module, tmp_path):
    start = time.monotonic()
    outcome = launch.run_child([*module, "sleep"], 2, tmp_path / "slow.log", fork=True)
    assert outcome.timed_out and time.monotonic() - start < 30
    child = zygote.popen([*module, "sleep"], dict(os.environ), str(tmp_path / "slow.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    launch._kill_group(child)  # what run_child does at a timeout or a Ctrl-C
    assert child.wait(5) == -signal.SIGTERM and not launch._group_running(child.pid)  # reaped by the zygote
