"""launch/zygote.py: a child forked from the zygote is what launch.run_child's Popen made, only sooner: its
own session, the environment and arguments given, its output in the log, its exit code, and ended with
whatever it started by a kill of its group (launch._kill_group), a timeout included. launch/forked.py:
the stand-in torchrun starts for a worker passes on its output, exit code and signals, and its death."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from parallel.launch import child as launch
from parallel.launch import zygote

pytestmark = pytest.mark.timeout(120)
SCRIPT = """import os, sys, time
print("argv", sys.argv[1:], "env", os.environ.get("ZYGOTE_TEST"), "session", os.getsid(0) == os.getpid())
print("pid", os.getpid(), "parent", os.getppid(), flush=True)
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
    assert f"parent {zygote._ONE[0].proc.pid}" in log.read_text()
    assert launch.run_child([*module, "0"], 60, log, fork=True).returncode == 0
    assert zygote.popen(["python3", "-c", "pass"], {}, str(log)) is None  # not `-m`: started the usual way


def test_a_forked_child_over_its_timeout_is_ended_with_its_group(module, tmp_path):
    start = time.monotonic()
    outcome = launch.run_child([*module, "sleep"], 1, tmp_path / "slow.log", fork=True)
    assert outcome.timed_out and time.monotonic() - start < 30
    child = zygote.popen([*module, "sleep"], dict(os.environ), str(tmp_path / "slow.log"))
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.5)
    launch._kill_group(child)  # what run_child does at a timeout or a Ctrl-C
    assert child.wait(5) == -signal.SIGTERM and not launch._group_running(child.pid)  # reaped by the zygote


def _gone(pid: int, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _stand_in(module, *args, env=None):
    """What torchrun's agent does for a worker: Popen the stand-in in a session of its own."""
    env = {**os.environ, **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "parallel.launch.forked", module, *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    first, second = proc.stdout.readline(), proc.stdout.readline()  # the worker's lines, through the stand-in
    pid, parent = map(int, second.split()[1::2])
    return proc, first, pid, parent


def test_a_stand_in_runs_its_worker_forked_with_its_output_exit_code_signals_and_death(module, tmp_path):
    env = {zygote.ENV: zygote._ONE[0].path, "ZYGOTE_TEST": "torchrun"}
    proc, first, pid, parent = _stand_in(module[2], "3", env=env)
    assert first == "argv ['3'] env torchrun session True\n" and parent == zygote._ONE[0].proc.pid
    assert proc.wait(30) == 3 and pid != proc.pid

    proc, _, pid, _ = _stand_in(module[2], "sleep", env=env)
    os.killpg(proc.pid, signal.SIGTERM)  # torchrun ending its group: the worker gets it, and dies of it
    assert proc.wait(30) == -signal.SIGTERM and _gone(pid)

    proc, _, pid, _ = _stand_in(module[2], "sleep", env=env)
    proc.kill()  # SIGKILL cannot be passed on: the zygote sees the stand-in hang up and kills its worker
    assert proc.wait(30) == -signal.SIGKILL and _gone(pid)

    # Nothing hangs the zygote: a connection that never sends, then a stand-in served after it.
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    idle.connect(zygote._ONE[0].path)
    proc, _, _, parent = _stand_in(module[2], "0", env=env)
    assert proc.wait(30) == 0 and parent == zygote._ONE[0].proc.pid
    idle.close()
    script = tmp_path / "zygote_probe.py"  # a script, as torchrun is given one: `python SCRIPT` in the fork
    proc, first, _, parent = _stand_in(str(script), "5", env=env)
    assert proc.wait(30) == 5 and parent == zygote._ONE[0].proc.pid and first.startswith("argv ['5']")


def test_a_stand_in_without_a_zygote_is_the_worker_itself(module, tmp_path):
    for target in (module[2], str(tmp_path / "zygote_probe.py")):
        proc, first, pid, parent = _stand_in(target, "4", env={zygote.ENV: ""})
        assert proc.wait(60) == 4 and pid == proc.pid and first.startswith("argv ['4']")


def test_a_stand_in_killed_before_it_read_its_start_is_a_hang_up_not_the_zygotes_end():
    """Linux resets a Unix socket closed with unread data: the zygote's read of it raises, and before the
    fix that ended the zygote (its killed stand-in's worker lived on)."""
    mine, stand_in = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.sendall(b"started")  # what the zygote tells a stand-in, never read
    stand_in.close()  # the stand-in killed
    with pytest.raises(ConnectionResetError):
        os.read(mine.fileno(), 1)
    mine2, stand_in2 = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine2.sendall(b"started")
    stand_in2.close()
    assert zygote._read_or_reset(mine2) == b""
    mine.close()
    mine2.close()
