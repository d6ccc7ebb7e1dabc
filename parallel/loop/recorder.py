"""Every rank's record of its last collectives, for the diagnosis of a hang (judge/hangs.py).

torch's own Flight Recorder keeps it: a ring of the last BUFFER collectives this process issued, on every
process group, from every caller (DDP's C++ reducer, FSDP2, DTensor, the hand-written strategies), with
its group, sequence number, op, input shapes and dtypes, and whether it finished. Read in the installed
torch (2.11 and 2.13, gloo):
- it is on by default, 2,000 entries: FlightRecorder.hpp reads `TORCH_FR_BUFFER_SIZE` (or its older
  name `TORCH_NCCL_TRACE_BUFFER_SIZE`) when the first group is made, and 0 turns it off;
- `_dump_fr_trace` returns the ring; a gloo entry's `state` stays "scheduled", but `retired` turns true
  when its work ends (measured: a collective a peer never joined stays unretired), and `pg_status` holds
  each group's last enqueued and completed numbers;
- nccl keeps a recorder of its own (FlightRecorder<CUDAEvent>, ProcessGroupNCCL.hpp), dumped apart by
  `_dump_nccl_trace` on a CUDA build, with the same fields and `state` filled: the record reads both
  (RECORDERS). Not run here (no GPU): read in torch's init.cpp, tested on a stand-in of its dump.
Where a torch has no Flight Recorder, the record holds the loop's marks only, and says so.

The project adds what torch cannot know: which training step issued each collective (the loop marks
each step's start, `mark`; a mark is a clock read and an append) and what the rank was doing. A rank
writes its record to FOLDER/rank<R>.json and .txt (one line a collective, to diff between ranks):
- when it fails (the worker calls `stop(error)`): a collective that timed out, a crash;
- when it stalls: a watch thread writes it once nothing has moved (no step, no collective issued or
  finished) for `stall_s` (40% of the collectives' own timeout), and the Python stacks of its threads
  beside it (rank<R>.stack.txt). A rank stuck in a collective cannot speak for itself; the thread can,
  since a waiting collective releases the GIL.
"""

from __future__ import annotations

import bisect
import contextlib
import faulthandler
import json
import os
import pickle
import re
import sys
import threading
import time
import traceback
from collections import deque
from pathlib import Path

import torch
import torch.distributed as td

from parallel.loop.results import atomic_write

BUFFER = 2000  # collectives each rank keeps (torch's ring; dumped only on a failure or a stall)
STALL_SHARE = 0.4  # the watch thread writes the record after this share of --pg-timeout without progress
DTYPES = {"Float": "fp32", "BFloat16": "bf16", "Half": "fp16", "Double": "fp64", "Long": "int64", "Int": "int32",
          "Byte": "uint8", "Bool": "bool", "Char": "int8"}


RECORDERS = ("_dump_fr_trace", "_dump_nccl_trace")  # the generic recorder (gloo's); nccl's, on CUDA builds


def enable() -> None:
    """torch's Flight Recorder on for this process, BUFFER entries (its own default, said here so that a
    torch with another default keeps the same), unless the user set its size; before the first group."""
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
    def __init__(self, folder: Path, rank: int, stall_s: float):
        self.folder, self.rank, self.stall_s = folder, rank, stall_s
        self.marks: deque[tuple[int, int]] = deque(maxlen=4 * BUFFER)  # (step, time_ns at its start)
        self.doing = "setting up (before the first step)"
        self.written = ""  # why the record was last written
        self._stop = threading.Event()
        # A rank that dies at once (gloo aborts the process on a collective whose sizes differ; a segfault)
        # writes no record: its Python stacks go here, through faulthandler, for the diagnosis to read.
        folder.mkdir(parents=True, exist_ok=True)
        self._fatal = open(folder / f"rank{rank}.fatal.txt", "w")  # noqa: SIM115 (open for the run's life)
        self._was_enabled = faulthandler.is_enabled()
        self._thread: threading.Thread | None = None
        faulthandler.enable(self._fatal, all_threads=True)

    def close(self) -> None:
        """Stop watching (a write under way ends first); the fatal file goes where nothing fatal happened,
        a stall's record where the rank went on after it, and the folder too if it is empty."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        faulthandler.disable()
        if self._was_enabled:  # as it was: to the process's stderr (pytest's capture has no file number)
            with contextlib.suppress(ValueError, OSError, AttributeError):
                faulthandler.enable(sys.__stderr__, all_threads=True)
        self._fatal.close()
        path = Path(self._fatal.name)
        if path.exists() and path.stat().st_size == 0:
            path.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()  # only when empty

    def mark(self, step: int, doing: str) -> None:
        if step >= 0 and (not self.marks or self.marks[-1][0] != step):
            self.marks.append((step, time.time_ns()))
        self.doing = doing

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
        status = {}
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
            if now != last:
                last, since = now, time.monotonic()
                if self.written:  # it went on: a slow stretch, not a hang; the next stall writes afresh
                    self._forget()
            elif time.monotonic() - since > self.stall_s and not self.written:
                self.write(f"no progress for {self.stall_s:g} s", stacks=True)

    def _forget(self) -> None:
        for suffix in ("json", "txt", "stack.txt"):
            with contextlib.suppress(OSError):
                (self.folder / f"rank{self.rank}.{suffix}").unlink()
        self.written = ""


_current: Recorder | None = None  # this process's recorder, while a run is in it (the worker's)


def start(folder: Path, rank: int, stall_s: float) -> Recorder:
    """The record of this rank's run, watched by a thread (a daemon: it never keeps a process alive)."""
    global _current
    _current = Recorder(folder, rank, stall_s)
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
    rec, _current = _current, None
    if rec is None:
        return
    rec.close()
    if error is not None:
        line = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", error_line(error))  # gloo's source location: noise
        frames = reversed(traceback.extract_tb(error.__traceback__))
        raised = "".join(f'  File "{f.filename}", line {f.lineno} in {f.name}\n' for f in frames)
        rec.write("it failed", error=line, raised=raised)


@contextlib.contextmanager
def recording(folder: Path, rank: int, pg_timeout: float):
    """This rank's record around a run: watched, written with the error if the run raises (and raised on)."""
    start(folder, rank, STALL_SHARE * pg_timeout)
    try:
        yield
    except BaseException as e:
        stop(e)
        raise
    finally:
        stop()  # nothing left to stop after an error


def error_line(error: BaseException) -> str:
    """`Type: its first line`: an error as one line (a collective's error runs to a dozen). One raised from a
    collective's failure (torch's pipelining wraps a stage's: "Failed to run stage backward") carries it
    after "from", so that the run is diagnosed as the hang it is, not as the rank's own crash."""
    line, cause = _first_line(error), error.__cause__ or error.__context__
    for _ in range(8):  # a chain of causes, not a cycle
        if cause is not None and from_a_collective(inner := _first_line(cause)):
            return f"{line} (from {inner})" if line != inner else line
        cause = cause and (cause.__cause__ or cause.__context__)
    return line


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: " + next((ln.strip() for ln in str(error).splitlines() if ln.strip()), "")


_COLLECTIVE_ERRORS = ("gloo", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed",
                      "monitoredBarrier", "Detected mismatch between collectives")
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")


def from_a_collective(error: str) -> bool:
    """Does this error ("RuntimeError: ...", or torchrun's "rank 1: RuntimeError: ...") come from a
    collective (its timeout, a peer gone, torch's check), not from the rank's own code?"""
    error = re.sub(r"^rank \d+: ", "", error)
    return error.startswith(_DIST_ERRORS) or (error.startswith("RuntimeError") and
                                               any(word in error for word in _COLLECTIVE_ERRORS))


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
