"""Start one strategy as a child process, the way a user would, and never wait on it forever.

    inprocess, hogwild:  python -m parallel.worker ...
    torchrun:            python -m torch.distributed.run --standalone --nproc_per_node=N -m parallel.worker ...

A child per strategy keeps thread settings, process groups and crashes from leaking into the next one.
Each child is the leader of its own process group, so a timeout kills it *and* its workers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    error: str | None  # the child's last meaningful stderr line, when it failed


def command(strategy, config, paths: dict[str, Path]) -> list[str]:
    worker = ["-m", "parallel.worker", "--strategy", strategy.name,
              "--config", str(paths["config"]), "--result", str(paths["result"]), "--state", str(paths["state"])]
    if strategy.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={strategy.world_size(config)}", *worker]
    return [sys.executable, *worker]


_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ([\w.]+(?:Error|Exception)\b.*)")
_ERROR = re.compile(r"^([\w.]+(?:Error|Exception|Interrupt)\b.*)")


def last_error_line(log: str) -> str | None:
    """The line that says what went wrong. Under torchrun, the first rank's own exception ("rank 1:
    ValueError: ..."), not torchrun's ChildFailedError that wraps it; else the last exception line;
    else the last non-empty line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in lines:
        if m := _RANK_ERROR.match(ln):
            return f"rank {m.group(1)}: {m.group(2)}"
    for ln in reversed(lines):
        if (m := _ERROR.match(ln)) and "ChildFailedError" not in ln:
            return m.group(1)
    return lines[-1] if lines else None


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's whole process group, then SIGKILL whatever is left after 5 s."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_child(cmd: list[str], timeout: float, log_path: Path, env: dict | None = None) -> Outcome:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:  # also on Ctrl-C in the parent: no child outlives the run
            _kill_group(proc)
    wall = time.perf_counter() - start
    error = None
    if timed_out:
        error = f"timed out after {timeout:g} s (log: {log_path})"
    elif proc.returncode != 0:
        error = last_error_line(log_path.read_text(errors="replace")) or f"exit code {proc.returncode}"
    return Outcome(proc.returncode, timed_out, wall, error)
