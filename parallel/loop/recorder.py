"""Every rank's record of its last collectives, for the diagnosis of a hang (judge/hangs.py).

torch's own Flight Recorder keeps it: a ring of the last BUFFER collectives this process issued, on every
group, from every caller (DDP's C++ reducer, FSDP2, DTensor, our own), with its group, sequence number,
op, input shapes and dtypes, and whether it finished. Read in torch 2.11 and 2.13 (gloo): it is on by
default (`TORCH_FR_BUFFER_SIZE`, read when the first group is made; 0 turns it off); `_dump_fr_trace`
returns it; a gloo entry's `retired` turns true when its work ends (a collective a peer never joined stays
unretired), and `pg_status` holds each group's last enqueued and completed numbers. nccl keeps its own
(`_dump_nccl_trace` on a CUDA build, the same fields): the record reads both (RECORDERS); not run here,
tested on a stand-in of its dump. Without a Flight Recorder the record holds the loop's marks only.

The project adds what torch cannot know: which training step issued each collective (the loop marks
each step's start, `mark`: a clock read, an append and a line written) and what the rank was doing. A
rank writes its record to FOLDER/rank<R>.json and .txt (one line a collective, to diff between ranks):
- when it fails (the worker calls `stop(error)`): a collective that timed out, a crash;
- when it stalls: a watch thread writes it once nothing has moved (no step, no collective issued or
  finished) for `stall_s` (40% of the collectives' own timeout), and the Python stacks of its threads
  beside it (rank<R>.stack.txt). A rank stuck in a collective cannot speak for itself; the thread can,
  since a waiting collective releases the GIL;
- stuck in a collective for `end_s` (2 timeouts + 2 s: a wait torch did not bound), the thread writes it
  with the error WATCH_ENDED and ends the rank (exit 1): the run ends, diagnosed as a timeout.
Always, what it is doing is a line rewritten at each mark (rank<R>.last.txt, gone when the run ends);
if its launcher ends it (torchrun's SIGTERM to all once one failed), faulthandler adds its stacks from
the signal. So a rank killed outright (SIGKILL) leaves what it was doing, and is told from one ended.
"""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import json
import os
import pickle
import re
import signal
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch
import torch.distributed as td

from parallel.loop.results import atomic_write
from parallel.world.errors import WATCH_ENDED, error_line, from_a_collective

BUFFER = 2000  # collectives each rank keeps (torch's ring; dumped only on a failure or a stall)
STALL_SHARE = 0.4  # the watch thread writes the record after this share of --pg-timeout without progress
END_SHARE, END_SLACK_S = 2.0, 2.0  # ... and ends a rank waiting in a collective after 2 x --pg-timeout + 2 s
DTYPES = {"Float": "fp32", "BFloat16": "bf16", "Half": "fp16", "Double": "fp64", "Long": "int64", "Int": "int32",
          "Byte": "uint8", "Bool": "bool", "Char": "int8"}
RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")  # the generic recorder (gloo's); nccl's, on CUDA builds


def enable() -> None:
    """torch's Flight Recorder on, BUFFER entries unless the user set its size; before the first group."""
    if "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ:
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER))


def flight_recorder() -> bool:
    return any(hasattr(torch._C._distributed_c10d, name) for name in RECORDERS)


def traces(collectives: bool = True) -> list[dict]:
    """Every Flight Recorder's dump this torch has (its entries without stack traces; only the groups'
    status when `collectives` is False: 0.02 ms)."""
    out = []
    for name in RECORDERS:
        dump = getattr(torch._C._distributed_c10d, name, None)
        if dump is None:
            continue
        try:
            out.append(pickle.loads(dump(collectives, False, False)))
        except (RuntimeError, ValueError, TypeError):  # a recorder this process never started
            continue
    return out


class Recorder:
    def __init__(self, folder: Path, rank: int, stall_s: float, end_s: float = float("inf")):
        self.folder, self.rank, self.stall_s, self.end_s = folder, rank, stall_s, end_s
        self.marks: deque[tuple[int, int]] = deque(maxlen=4 * BUFFER)  # (step, time_ns at its start)
        self.doing = "setting up (before the first step)"
        self.written = ""  # why the record was last written
        self._stop = threading.Event()
        # A rank that dies at once (gloo aborts the process on a collective whose sizes differ; a segfault)
        # writes no record: its Python stacks go here, through faulthandler, for the diagnosis to read.
        folder.mkdir(parents=True, exist_ok=True)
        self._fatal = open(folder / f"rank{rank}.fatal.txt", "w")  # noqa: SIM115 (open for the run's life)
        self._last = open(folder / f"rank{rank}.last.txt", "w")  # noqa: SIM115 (what it does; SIGTERM's stacks)
        self._was_enabled = faulthandler.is_enabled()
        self._thread: threading.Thread | None = None
        faulthandler.enable(self._fatal, all_threads=True)
        faulthandler.register(signal.SIGTERM, self._last, all_threads=True, chain=True)
        self.mark(-1, self.doing)

    def close(self, keep_signals: bool = False) -> None:
        """Stop watching (a write under way ends first); then, unless `keep_signals`, unused files go."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if keep_signals or self._fatal.closed:
            return
        faulthandler.disable()
        faulthandler.unregister(signal.SIGTERM)
        if self._was_enabled:  # as it was: to the process's stderr (pytest's capture has no file number)
            with contextlib.suppress(ValueError, OSError, AttributeError):
                faulthandler.enable(sys.__stderr__, all_threads=True)
        for file in (self._fatal, self._last):
            file.close()
            path = Path(file.name)
            if path.exists() and (file is self._last or path.stat().st_size == 0):
                path.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # only when empty

    def mark(self, step: int, doing: str) -> None:
        if step >= 0 and (not self.marks or self.marks[-1][0] != step):
            self.marks.append((step, time.time_ns()))
        self.doing = doing
        with contextlib.suppress(OSError, ValueError):  # one write; a signal's stacks would follow it
            self._last.seek(0)
            self._last.write(f"{doing}\n")
            self._last.truncate()
            self._last.flush()

    def snapshot(self, error: str = "") -> dict:
        """This rank's record as plain data (JSON)."""
        out = {"rank": self.rank, "pid": os.getpid(), "doing": self.doing, "error": error,
               "step": self.marks[-1][0] if self.marks else -1, "time_ns": time.time_ns(),
               "source": f"torch {torch.__version__} flight recorder" if flight_recorder() else
               "none: this torch has no flight recorder", "groups": {}, "status": {}, "entries": []}
        if not flight_recorder() or not td.is_initialized():
            return out
        dumps, marks = traces(), list(self.marks)  # a copy: the loop appends while the watch thread reads
        out["groups"] = _groups()
        out["status"] = {k: v for t in dumps for k, v in t.get("pg_status", {}).items()}
        out["entries"] = sorted((_entry(e, marks) for t in dumps for e in t.get("entries", [])),
                                key=lambda e: e["time_ns"])
        return out

    def write(self, why: str, error: str = "", stacks: bool = False, raised: str = "") -> None:
        """Write the record (atomically) and, from the watch thread, every thread's Python stack. `raised`:
        where the error was raised, most recent frame first (faulthandler's form)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        record = self.snapshot(error) | {"written": why, "stack": raised}
        since = self.marks[-1][1] if self.marks else 0
        if from_a_collective(error) and record["entries"]:
            last = max(record["entries"], key=lambda e: e["time_ns"])
            if last["time_ns"] >= since:  # issued in this step: torch retires a failed one as if it had finished
                last["state"] = "failed"  # (one the recorder misses, a gloo send, leaves the last alone)
        atomic_write(self.folder / f"rank{self.rank}.json", json.dumps(record))
        atomic_write(self.folder / f"rank{self.rank}.txt", "\n".join(text_lines(record)) + "\n")
        if stacks:
            with open(self.folder / f"rank{self.rank}.stack.txt", "w") as f:
                faulthandler.dump_traceback(f, all_threads=True)
        self.written = why

    def _progress(self) -> tuple:
        status = []
        if flight_recorder() and td.is_initialized():
            status = [t.get("pg_status", {}) for t in traces(collectives=False)]
        return len(self.marks), self.doing, json.dumps(status, sort_keys=True)

    def _watch(self) -> None:
        last, since = None, time.monotonic()
        while not self._stop.wait(min(0.25, self.stall_s / 4)):
            try:
                now = self._progress()
            except Exception:  # noqa: BLE001 (a group torn down under the thread: nothing to watch)
                return
            idle = time.monotonic() - since
            if now != last:
                last, since = now, time.monotonic()
                if self.written:  # it went on: a slow stretch, not a hang; the next stall writes afresh
                    self._forget()
            elif idle > self.end_s and waiting(json.loads(now[2])):
                self._end(idle)
            elif idle > self.stall_s and not self.written:
                self.write(f"no progress for {self.stall_s:g} s", stacks=True)

    def _end(self, idle: float) -> None:
        """End this rank, stuck in a collective that torch's timeout did not end: its record first."""
        error = (f"TimeoutError: no progress for {idle:.0f} s inside a collective, past twice --pg-timeout: "
                 f"{WATCH_ENDED} (a wait torch did not bound)")
        self.write(f"stuck for {idle:.0f} s", error=error, stacks=True)
        print(f"[rank{self.rank}]: {error}", file=sys.stderr, flush=True)
        os._exit(1)

    def _forget(self) -> None:
        for suffix in ("json", "txt", "stack.txt"):
            with contextlib.suppress(OSError):
                (self.folder / f"rank{self.rank}.{suffix}").unlink()
        self.written = ""


def waiting(status: list[dict]) -> bool:
    """Does torch's status (each recorder's pg_status) say a collective was issued and has not finished?"""
    return any(int(g.get("last_enqueued_collective", -1)) > int(g.get("last_completed_collective", -1))
               for s in status for g in s.values())


_current: Recorder | None = None  # this process's recorder, while a run is in it (the worker's)


def start(folder: Path, rank: int, stall_s: float, end_s: float = float("inf")) -> Recorder:
    """The record of this rank's run, watched by a thread (a daemon: it never keeps a process alive)."""
    global _current
    _current = Recorder(folder, rank, stall_s, end_s)
    _current._thread = threading.Thread(target=_current._watch, name="parallel-recorder", daemon=True)
    _current._thread.start()
    return _current


def mark(step: int, doing: str) -> None:
    """The loop's mark: `step` begins, or the rank is now `doing` something else (no-op without a record)."""
    if _current is not None:
        _current.mark(step, doing)


def stop(error: BaseException | None = None) -> None:
    """The run ended: on an error, write the record with it (a collective's timeout names nothing else)."""
    global _current
    if (rec := _current) is None:
        return
    _current = None
    rec.close(keep_signals=error is not None)
    if error is not None:  # written before the launcher's SIGTERM is let go: a rank ended mid-write leaves its stacks
        line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", error_line(error))  # gloo's source location: noise
        frames = reversed(traceback.extract_tb(error.__traceback__))
        raised = "".join(f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in frames)
        rec.write("it failed", error=line, raised=raised)
        rec.close()


@contextlib.contextmanager
def recording(folder: Path, rank: int, pg_timeout: float):
    """This rank's record around a run: watched, written with the error if the run raises (and raised on)."""
    start(folder, rank, STALL_SHARE * pg_timeout, END_SHARE * pg_timeout + END_SLACK_S)
    try:
        yield
    except BaseException as e:
        stop(e)
        raise
    finally:
        stop()  # nothing left to stop after an error


def _entry(e: dict, marks: list[tuple[int, int]]) -> dict:
    """One Flight Recorder entry in the record's words, with the training step that issued it."""
    sizes = [list(s) for s in e.get("input_sizes", [])]
    dtypes = sorted({DTYPES.get(d, d) for d in e.get("input_dtypes", [])})
    p2p = bool(e.get("is_p2p"))
    done = e.get("retired") or e.get("state") == "completed"
    return {"group": e["process_group"][0], "seq": e["p2p_seq_id" if p2p else "collective_seq_id"],
            "p2p": p2p, "op": e["profiling_name"].split(":")[-1], "sizes": sizes, "dtype": "/".join(dtypes),
            "step": _step_at(marks, e["time_created_ns"]), "state": "finished" if done else "started",
            "time_ns": e["time_created_ns"]}


def _step_at(marks: list[tuple[int, int]], time_ns: int) -> int:
    """The step that had begun last at `time_ns` (marks: (step, its start), in order); -1 before the first."""
    at = bisect.bisect_right(marks, time_ns, key=lambda m: m[1])
    return marks[at - 1][0] if at else -1


def _groups() -> dict[str, list[int]]:
    """Every process group this rank belongs to, by the name the recorder gives it: its global ranks."""
    names = getattr(td.distributed_c10d._world, "pg_names", {})
    out = {}
    for pg, name in list(names.items()):
        try:
            out[name] = td.get_process_group_ranks(pg)
        except (RuntimeError, ValueError):
            continue
    return out


def describe(entry: dict) -> str:
    """`all_reduce(1024 fp32)`: the op and what it carries (elements of its inputs, their dtype)."""
    counts = [int(torch.Size(s).numel()) for s in entry["sizes"]]
    what = "+".join(map(str, counts)) if len(counts) > 1 else str(sum(counts))
    return f"{entry['op']}({what} {entry['dtype']})".replace(" )", ")")


def text_lines(record: dict) -> list[str]:
    """The record as lines to diff between ranks: a header, then one line a collective, oldest first."""
    head = [f"# rank {record['rank']}: {record['doing']}; written because {record.get('written', '')}",
            f"# {record['source']}; error: {record['error'] or 'none'}"]
    rows = []
    for e in record["entries"]:
        kind = "p2p" if e["p2p"] else "#"
        ranks = record["groups"].get(e["group"], [])
        rows.append(f"group {e['group']} {ranks}  {kind}{e['seq']}  {describe(e)}  "
                    f"{[list(s) for s in e['sizes']]}  step {e['step']}  {e['state']}")
    return head + rows
