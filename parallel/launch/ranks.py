"""N spawned processes in one gloo group, in seconds: collective code in tests, and the oracle's runs.

    results = run_ranks(fn, world=2, args=(x,), timeout=60)   # fn(rank, world, *args) in every rank

In the spirit of torch's MultiProcessTestCase and accelerate's debug_launcher: the ranks meet through a
FileStore in a fresh temporary folder (no port, so nothing to collide with), every collective has the
timeout, and the first failing rank's exception comes back with its traceback, or a TimeoutError names
the ranks that did not finish. `fn` must be importable (defined at module level) for the rank to find it.

The ranks fork from multiprocessing's fork server, which has imported torch and this package once (dist.PRELOAD):
a rank then starts in milliseconds instead of importing them afresh (about 2.5 s of CPU a rank on a 2-core
machine, where the test suite starts about a hundred ranks). The server itself runs no tensor operation, so
no thread pool or CUDA context is forked; each rank gets the caller's environment as it is at the call.
"""

from __future__ import annotations

import os
import pickle
import queue
import tempfile
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as td

from parallel.world.dist import every_group_times_out, fresh_processes


class RankError(RuntimeError):
    pass


def run_ranks(fn, world: int, args: tuple = (), timeout: float = 60.0, total: float | None = None) -> list:
    """fn(rank, world, *args) in `world` spawned ranks; their return values in rank order. `timeout`: what
    one collective may wait; `total`: what the whole may take (default: timeout)."""
    ctx = fresh_processes()
    with tempfile.TemporaryDirectory(prefix="ranks-") as folder:
        results = ctx.Queue()
        # The arguments by value, as the results: a tensor pickled for multiprocessing travels as a file
        # descriptor, and a fork server takes at most 256 of them (ValueError: too many fds).
        sent = (os.path.join(folder, "store"), timeout, pickle.dumps(args), results, dict(os.environ), os.getpid())
        procs = [ctx.Process(target=_rank, args=(fn, rank, world, *sent), name=f"rank-{rank}", daemon=True)
                 for rank in range(world)]
        for p in procs:
            p.start()
        try:
            return _collect(procs, results, timeout if total is None else total)
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(5)


def _collect(procs, results, timeout: float) -> list:
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout + 30  # start-up (importing torch) on top of the collectives' timeout
    while len(out) < len(procs):
        try:
            rank, ok, value = results.get(timeout=0.2)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in out and not p.is_alive() and p.exitcode]
            if dead:  # the others see it at once (a peer gone): a moment for their reports and records
                _root_cause([(dead[0], time.time(), f"died (exit code {procs[dead[0]].exitcode})")], results,
                            world=len(procs))
                raise RankError(f"rank {dead[0]} died (exit code {procs[dead[0]].exitcode})") from None
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - out.keys())
                raise TimeoutError(f"ranks {missing} did not finish in {timeout + 30:g} s") from None
            continue
        if not ok:
            raise RankError(_root_cause([(rank, *value)], results, world=len(procs)))
        out[rank] = pickle.loads(value)
    return [out[r] for r in range(len(procs))]


def _root_cause(errors: list[tuple], results, grace_s: float = 2.0, world: int = 0) -> str:
    """One rank's failure makes the others fail too ("Connection closed by peer"), sometimes sooner than
    its own report arrives: wait a moment for the others (not once all `world` have reported), and name
    the one that failed first."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and not (world and len({e[0] for e in errors}) >= world):
        try:
            rank, ok, value = results.get(timeout=0.1)
        except queue.Empty:
            continue
        if not ok:
            errors.append((rank, *value))
    rank, _, message = min(errors, key=lambda e: e[1])
    return f"rank {rank}: {message}"


def _orphaned(caller: int, every_s: float = 1.0) -> None:
    """End this rank when the process that started it is gone (killed: no one will read its result). Its
    parent is the fork server, which outlives the caller, so nothing else would stop it."""
    while True:
        time.sleep(every_s)
        try:
            os.kill(caller, 0)
        except ProcessLookupError:
            os._exit(1)


def _rank(fn, rank: int, world: int, store_path: str, timeout: float, args: bytes, results, env: dict,
          caller: int) -> None:
    os.environ.clear()  # the server's environment is the one it started with: the caller's now
    os.environ.update(env)
    torch.set_num_threads(1)
    threading.Thread(target=_orphaned, args=(caller,), daemon=True).start()
    try:
        store = td.FileStore(store_path, world)
        td.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout))
        every_group_times_out(timeout)  # the groups a test or a strategy makes, too
        try:
            # Pickled here, by value: a tensor sent as it is travels as a shared-memory handle, which is
            # gone once this process has exited ("Connection reset by peer" in the parent).
            results.put((rank, True, pickle.dumps(fn(rank, world, *pickle.loads(args)))))
        except BaseException as e:  # reported before the group is torn down, which fails the other ranks
            results.put((rank, False, (time.time(), f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        finally:
            td.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - sent to the parent, which raises it naming the rank
        results.put((rank, False, (time.time(), f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
