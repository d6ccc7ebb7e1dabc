"""Start one strategy as a child process, the way a user would, and never wait on it forever.

    inprocess, hogwild:  python -m parallel.worker ...
    torchrun:            python -m torch.distributed.run --nnodes=1 --nproc_per_node=N
                             --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:PORT --rdzv-conf=is_host=false
                             -m parallel.worker ...          (on CPU: -m parallel.launch.forked parallel.worker ...)

A child per strategy keeps thread settings, process groups and crashes from leaking into the next one.
Each child is the leader of its own process group, so a timeout kills it *and* its workers. On CPU the
child is forked from the zygote (zygote.py), which has imported torch once: the same child, 6 s sooner;
so are torchrun's workers, through the stand-in torchrun starts instead of each (forked.py).

Loopback only: torch's TCPStore server listens on every interface, whatever host it is given, and
`torchrun --standalone` hosts two of them (pytorch#173909; seen here with `ss -ltnp`: *:PORT).
torch.distributed has no authentication, so the harness hosts the rendezvous store itself on a socket
bound to 127.0.0.1 (TCPStore's master_listen_fd), torchrun joins it as a client (is_host=false), and
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 leaves the workers' store to rank 0, which binds it to loopback
the same way (Dist.init); it also lets a restarted group meet in a fresh store (pytorch#135712). gloo
listens where the rendezvous address resolves, 127.0.0.1. NCCL's bootstrap picks its own interface
(the first that is not loopback, unless NCCL_SOCKET_IFNAME says otherwise), so these single-node
launches set NCCL_SOCKET_IFNAME=lo unless the user set it. Every listening socket of a harness run is
then on 127.0.0.1 (checked by a test for gloo; the NCCL half needs GPUs and was not run here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from parallel.launch import zygote
from parallel.loop.timing import LAUNCHED_AT
from parallel.world.errors import THEIRS, ConfigError


@dataclass
class Outcome:
    returncode: int | None
    timed_out: bool
    wall_s: float
    error: str | None  # the child's last meaningful stderr line, when it failed


def loopback_socket(port: int = 0) -> socket.socket:
    """A listening TCP socket on 127.0.0.1 (port 0: any free one); ConfigError if the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--port {port} on 127.0.0.1 is not free: {e.strerror}") from None
    sock.listen()
    return sock


class LoopbackStore:
    """The rendezvous store of one torchrun launch, hosted here and reachable on 127.0.0.1 only."""

    def __init__(self, port: int, timeout_s: float):
        import torch.distributed as td

        sock = loopback_socket(port)
        self.port = sock.getsockname()[1]
        # The store takes the fd over and closes it when it is destroyed: Python must let go of it.
        self.store = td.TCPStore("127.0.0.1", self.port, is_master=True, wait_for_workers=False, multi_tenant=True,
                                 timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.detach())

    def close(self) -> None:
        del self.store


def command(strategy, config, paths: dict[str, Path], rdzv_port: int = 0, run: str = "",
            fork: bool = False) -> list[str]:
    """The child's command line; `run`: its folder in OUT/tb/ (results.tb_run: a variant's own); `fork`:
    torchrun starts each worker through forked.py, which has the zygote fork it."""
    stand_in = ["parallel.launch.forked"] if fork and strategy.launch == "torchrun" else []
    worker = ["-m", *stand_in, "parallel.worker", "--strategy", strategy.name, "--config", str(paths["config"]),
              "--result", str(paths["result"]), "--state", str(paths["state"]), "--tb-run", run or strategy.name]
    if strategy.launch == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1",
                f"--nproc_per_node={strategy.world_size(config)}", f"--max-restarts={config.max_restarts}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{rdzv_port}", "--rdzv-conf=is_host=false",
                "--local-addr=127.0.0.1", *worker]
    return [sys.executable, *worker]


_RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ([\w.]+(?:Error|Exception)\b.*)")
_ERROR = re.compile(r"^([\w.]+(?:Error|Exception|Interrupt)\b.*)")


_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\n(.*?)\n={20,}", re.S)


def last_error_line(log: str) -> str | None:
    """The line that says what went wrong. Under torchrun: the root cause of its failure summary (the
    worker's @record wrote its traceback to torchrun's error file), "rank 1: InjectedFault: ...", not the
    ChildFailedError that wraps it; else a rank's own exception line; else the last exception line; else
    the last non-empty line."""
    if m := _ROOT_CAUSE.search(log):
        block = [ln.strip() for ln in m.group(1).splitlines() if ln.strip()]
        rank = next((ln.split(":", 1)[1].split()[0] for ln in block if ln.startswith("rank ")), "?")
        exc = block[-1].removeprefix("traceback :").strip()
        name, _, message = exc.partition(":")
        return f"rank {rank}: {name.rsplit('.', 1)[-1]}:{message}"
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    if theirs := [ln for ln in lines if ln.startswith(THEIRS.strip())]:  # the user's code raised it (worker.main)
        return theirs[-1].removeprefix(THEIRS.strip()).strip()
    for ln in lines:
        if m := _RANK_ERROR.match(ln):
            return f"rank {m.group(1)}: {m.group(2)}"
    for ln in reversed(lines):
        if (m := _ERROR.match(ln)) and "ChildFailedError" not in ln:
            return m.group(1)
    return lines[-1] if lines else None


def first_failure(result: Path) -> str | None:
    """The failure that came first in the last attempt of a torchrun run, from the notes its ranks left
    beside `result` (worker.note_failure): "rank 1: InjectedFault: ..."; None where none failed."""
    notes = [json.loads(p.read_text()) for p in result.parent.iterdir()
             if p.name.startswith(f"{result.stem}.failure") and p.suffix == ".json"]
    if not notes:
        return None
    last = max(n["restart"] for n in notes)
    first = min((n for n in notes if n["restart"] == last), key=lambda n: n["time"])
    return f"rank {first['rank']}: {first['error']}"


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM the child's whole process group, then SIGKILL whatever is left after 5 s; return once no
    process of the group runs. (Waiting for the child alone returned while a grandchild that had been
    signalled was still running, or one that ignores SIGTERM lived on: seen under load in the suite.)"""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            proc.poll()  # reap the child itself
            if not _group_running(proc.pid):
                return
            time.sleep(0.02)


def _group_running(pgid: int) -> bool:
    """Whether any process of the group still runs; a zombie (dead, not yet reaped by its parent) does not."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stats = list(Path("/proc").glob("[0-9]*/stat"))
    if not stats:  # no /proc (not Linux): the signal reached someone
        return True
    for stat in stats:
        try:
            state, _, group = stat.read_text().rsplit(")", 1)[1].split()[:3]  # after the command's name
        except (OSError, ValueError):
            continue  # gone meanwhile
        if int(group) == pgid and state != "Z":
            return True
    return False


def torchrun_env() -> dict[str, str]:
    """What every torchrun launch of the harness adds to the environment (see the module docstring)."""
    return {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "NCCL_SOCKET_IFNAME": os.environ.get("NCCL_SOCKET_IFNAME", "lo")}


def may_fork(gpus: bool) -> bool:
    """Whether a child may start from the zygote: yes, unless PARALLEL_FORK_GPU=0 keeps GPU runs' children
    fresh interpreters (the zygote never touches CUDA, so each child initialises its own; zygote.py)."""
    return not gpus or os.environ.get("PARALLEL_FORK_GPU", "1") != "0"


def run_child(cmd: list[str], timeout: float, log_path: Path, env: dict | None = None, fork: bool = False) -> Outcome:
    """`cmd` in a session of its own, its output to log_path, ended (with all it started) at `timeout`;
    `fork`: started from the zygote (launch/zygote.py: no 6 s of imports), where it can."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", LAUNCHED_AT: repr(time.time()), **(env or {})}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = zygote.popen(cmd, env, str(log_path)) if fork else None
        proc = proc or subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
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
