"""`python -m parallel.launch.forked MODULE ARGS` runs `python -m MODULE ARGS` (or SCRIPT.py ARGS, `python
SCRIPT.py ARGS`): forked from the zygote that $PARALLEL_ZYGOTE names (launch/zygote.py), or here, as a new
interpreter, when there is none.

torchrun starts every worker as a new interpreter: 6 s of imports on this machine before a rank trains,
paid again at every restart. On CPU runs the harness has torchrun start this module instead (launch.py).
It imports nothing heavy and stands in for the worker towards torchrun's agent:

    the worker      forked by the zygote, with this process's environment, folder, stdin/stdout/stderr
    a signal        received here (the agent's SIGTERM to end a group) goes to the worker's process group
    a SIGKILL here  closes the connection; the zygote kills the worker
    the exit        the worker's code, or death by the worker's signal, is this process's own
    no zygote       (GPU runs; a zygote gone, or one that dropped the request): this process runs it

No torch here: this file also holds the zygote's message format, so both ends read the same bytes.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import struct
import sys

ENV = "PARALLEL_ZYGOTE"  # the zygote's socket, in the environment of what it starts
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def send(fd: int, obj) -> None:
    data = memoryview(struct.pack("!I", len(d := pickle.dumps(obj))) + d)
    while data:  # a pipe may take a large message in parts
        data = data[os.write(fd, data) :]


def receive(source: int | socket.socket):
    """The next message from a file descriptor, or a socket (with its timeout); None at end of file."""
    read = source.recv if isinstance(source, socket.socket) else lambda n: os.read(source, n)

    def exactly(n: int) -> bytes:
        buf = b""
        while len(buf) < n and (chunk := read(n - len(buf))):
            buf += chunk
        return buf

    head = exactly(4)
    return pickle.loads(exactly(struct.unpack("!I", head)[0])) if len(head) == 4 else None


def main() -> None:
    module, args = sys.argv[1], sys.argv[2:]
    worker, pending = [], []

    def forward(sig, _frame) -> None:
        if not worker:
            pending.append(sig)
            return
        try:
            os.killpg(worker[0], sig)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    if (conn := _connect(os.environ.get(ENV, ""))) is not None:
        try:
            socket.send_fds(conn, [b"f"], [0, 1, 2])
            send(conn.fileno(), (module, args, dict(os.environ), os.getcwd()))
            started = receive(conn.fileno())
        except OSError:
            started = None
        if started is not None:
            worker.append(started[1])
            for sig in pending:
                forward(sig, None)
            _end_as(receive(conn.fileno()), module, worker[0])
    # No zygote (GPU runs, or it is gone, or it dropped this request): this interpreter is the worker.
    for sig in FORWARDED:
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for sig in pending:
        os.kill(os.getpid(), sig)
    sys.argv = [module, *args]
    sys.path[0] = first_path(module, os.getcwd())
    run_as_main(module)


def first_path(target: str, cwd: str) -> str:
    """sys.path[0] as `python SCRIPT.py` (the script's folder) or `python -m MODULE` (`cwd`) sets it."""
    return os.path.dirname(os.path.abspath(target)) if target.endswith(".py") else cwd


def run_as_main(target: str) -> None:
    """Run a script or a module as __main__, as `python SCRIPT.py` or `python -m MODULE` would."""
    import runpy

    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)


def _end_as(ended, module: str, pid: int) -> None:
    """Exit as the worker did: its code, or death by its signal, as the agent expects of its worker."""
    if ended is None:
        sys.exit(f"{module}: the zygote ended before its worker (pid {pid})")
    code = ended[2]
    if code < 0:
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose handler cannot be set
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code if code >= 0 else 128 - code)


def _connect(path: str) -> socket.socket | None:
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        return None
    return conn


if __name__ == "__main__":
    main()
