"""A strategy's child process in milliseconds: `python -m MODULE ARGS` forked from a process that has
imported torch, dynamo and the package once, as multiprocessing's fork server does for the tests' ranks.

    child = zygote.popen([sys.executable, "-m", MODULE, *ARGS], env, log)   # or None: start it the usual way
    child.wait(timeout); child.poll(); child.pid; child.returncode

On this 2-core machine a fresh interpreter spends about 6 s before it trains (torch 2.5 s, the dynamo every
optimizer imports 2 s, its exit) and torchrun's agent 3 s: most of a small comparison. A child from here
behaves as launch.run_child's Popen did: it leads a new session (killpg ends it and whatever it started),
reads /dev/null, writes stdout and stderr to its log, gets the environment given, and runs the module as
__main__ (runpy). torchrun's agent starts this way too; its workers are new interpreters (torchrun's own).

The zygote is a new interpreter itself (not a fork of the parent, which has threads), single-threaded,
and runs no tensor operation: no thread pool, lock or CUDA context is forked, so each child initialises
CUDA for itself. On GPUs too (measured on an H100, torch 2.11, 2026-11-26: six CNN rows on cuda:0x2 gave
the same verdicts forked as fresh, and a row's launch took 0.9-3.0 s instead of 10-16.5 s, of which 4-6 s
had been the imports and CUDA's start in each child); PARALLEL_FORK_GPU=0 starts GPU children the usual
way (launch.may_fork). It ends when the parent closes its pipe, the parent's exit included.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from parallel.launch.forked import ENV, first_path, receive, run_as_main, send
from parallel.world.dist import PRELOAD as RANKS_PRELOAD

PRELOAD = [*RANKS_PRELOAD, "torch.distributed.run"]  # the tests' ranks' imports, and torchrun's agent


class Child:
    """The part of subprocess.Popen that launch.run_child uses."""

    def __init__(self, zygote: _Zygote, pid: int):
        self._zygote, self.pid, self.returncode = zygote, pid, None

    def poll(self) -> int | None:
        self.returncode = self._zygote.status(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self.returncode = self._zygote.status(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode


class _Zygote:
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="parallel-zygote-")  # 0700: this user's processes only
        self.path = os.path.join(self.folder, "socket")  # where forked.py's stand-ins ask for workers
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, self.path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        self.cond, self.exits, self.pids, self.gone = threading.Condition(), {}, [], False
        threading.Thread(target=self._read, name="zygote", daemon=True).start()

    def _read(self) -> None:
        while (msg := receive(self.proc.stdout.fileno())) is not None:
            kind, pid, code = msg
            with self.cond:
                if kind == "started":
                    self.pids.append(pid)
                else:
                    self.exits[pid] = code
                self.cond.notify_all()
        with self.cond:
            self.gone = True  # whoever waits for a start gets None, and nobody asks it again
            self.cond.notify_all()

    def popen(self, module: str, args: list[str], env: dict, log: str) -> Child | None:
        with self.cond:
            n = len(self.pids)
            try:
                send(self.proc.stdin.fileno(), (module, args, {**env, ENV: self.path}, os.getcwd(), log))
            except OSError:
                return None
            self.cond.wait_for(lambda: len(self.pids) > n or self.gone, timeout=120)
            pid = self.pids[n] if len(self.pids) > n else None
        return Child(self, pid) if pid else None

    def status(self, pid: int, timeout: float | None) -> int | None:
        with self.cond:
            self.cond.wait_for(lambda: pid in self.exits, timeout=timeout)
            return self.exits.get(pid)

    def close(self) -> None:
        """At the parent's exit: the closed pipe ends the zygote; one still importing torch (a run stopped
        in its first seconds, on a busy machine) does not read it in time and is killed instead."""
        self.proc.stdin.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


_ONE: list[_Zygote] = []


def popen(cmd: list[str], env: dict, log: str) -> Child | None:
    """Start `cmd` ([python, "-m", MODULE, ...]) from the zygote (started at the first call); None if it
    cannot (another command, or a zygote that died): the caller starts it the usual way."""
    if cmd[:2] != [sys.executable, "-m"]:
        return None
    if not _ONE:
        _ONE.append(_Zygote())
        atexit.register(_ONE[0].close)
    return None if _ONE[0].gone else _ONE[0].popen(cmd[2], cmd[3:], env, log)


def _become(module: str, args: list[str], env: dict, cwd: str, log: str | None, fds=(None, None, None)) -> None:
    """In the forked child: what Popen(start_new_session=True, stdin=DEVNULL, stdout=log, stderr=STDOUT,
    env=env) and `python -m module args` would have made of it; or, for a stand-in (forked.py), with its
    stdin, stdout and stderr `fds`. Never returns."""
    code = 1
    try:
        os.setsid()
        if log is not None:  # (opened above 2: 0 and 1 are still the zygote's pipe here)
            out = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
            fds = (os.open(os.devnull, os.O_RDONLY), out, out)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - line-buffered, like a log wants
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        # sys.path as `python -m` in cwd (or `python SCRIPT`) with this PYTHONPATH makes it (the zygote's were
        # its own start's)
        sys.path[:] = [first_path(module, cwd), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep)),
                       *_BASE_PATH]
        sys.argv = [module, *args]
        import warnings

        # The module is imported already (PRELOAD); running it as __main__ is what `python -m` does.
        warnings.filterwarnings("ignore", "'.*' found in sys.modules after import of package", RuntimeWarning)

        run_as_main(module)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - printed as the interpreter would, then the exit code 1
        import traceback

        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


_BASE_PATH: list[str] = []  # the zygote's sys.path without its start's folder and PYTHONPATH


def _serve(path: str) -> None:
    """Fork a child for each request: the parent's, on stdin (its exit code goes back on stdout), and a
    stand-in's, on a connection to `path` (its exit code goes back there; its hang-up kills the child)."""
    import importlib

    own = {os.getcwd(), "", *os.environ.get("PYTHONPATH", "").split(os.pathsep)}
    _BASE_PATH[:] = [p for p in sys.path[1:] if p not in own]

    for name in PRELOAD:
        importlib.import_module(name)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent's Ctrl-C is the parent's to handle
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    requests, replies = sys.stdin.fileno(), sys.stdout.fileno()
    # pid -> who is told of its exit: a stand-in's connection, None (the parent) or False (nobody)
    children: dict[int, socket.socket | None | bool] = {}
    stand_ins: dict[socket.socket, int] = {}  # a stand-in's connection -> its child
    while True:
        ready, _, _ = select.select([requests, listener, *stand_ins], [], [], 0.05)
        for pid, conn in list(children.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                del children[pid]
                _tell(conn, stand_ins, replies, ("exited", pid, os.waitstatus_to_exitcode(status)))
        for source in ready:
            if source is requests:
                if (request := receive(requests)) is None:  # the parent closed the pipe (or is gone)
                    return
                pid = _fork(request, [listener, *stand_ins])
                children[pid] = None
                send(replies, ("started", pid, None))
            elif source is listener:
                conn, _ = listener.accept()
                conn.settimeout(1)  # a stand-in sends at once; one that does not is dropped (and runs itself)
                fds: list[int] = []
                try:
                    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
                    request = receive(conn) if len(fds) == 3 else None
                    conn.settimeout(None)
                except OSError:
                    request = None
                pid = _fork((*request, None, fds), [listener, conn, *stand_ins]) if request else None
                for fd in fds:
                    os.close(fd)
                if pid is None:
                    conn.close()
                    continue
                children[pid], stand_ins[conn] = conn, pid
                send(conn.fileno(), ("started", pid, None))
            elif not _read_or_reset(source):  # a stand-in hung up (killed): so is its child
                pid = stand_ins.pop(source)
                source.close()
                if pid in children:
                    children[pid] = False
                    _kill(pid)


def _read_or_reset(conn: socket.socket) -> bytes:
    """A byte from a stand-in, or b"" when it hung up. A stand-in killed before it read the "started" sent to
    it resets the connection (Linux: a Unix socket closed with unread data), and the read raises
    ConnectionResetError: a hang-up too, not the zygote's end (seen once in the full suite: the zygote died,
    the killed stand-in's worker lived on, and every later fork fell back to a fresh interpreter)."""
    try:
        return os.read(conn.fileno(), 1)
    except ConnectionResetError:
        return b""


def _fork(request: tuple, sockets: list[socket.socket]) -> int:
    pid = os.fork()
    if pid == 0:
        for sock in sockets:
            sock.close()
        _become(*request)  # its stdin and stdout (the parent's pipe) are replaced there
    return pid


def _tell(conn: socket.socket | None | bool, stand_ins: dict, replies: int, message: tuple) -> None:
    if conn is None:
        send(replies, message)
    elif conn is not False:
        with contextlib.suppress(OSError):  # a stand-in gone meanwhile
            send(conn.fileno(), message)
        stand_ins.pop(conn, None)
        conn.close()


def _kill(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    _serve(sys.argv[1])
