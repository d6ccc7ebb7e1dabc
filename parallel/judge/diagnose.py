"""The ranks' records on disk (OUT/hang/<run>/, written by loop/recorder.py), read for judge/hangs.py's
one line, and `python -m parallel diagnose DIR`, which says it for a folder a script's ranks left.

    rank<R>.json, .txt   the rank's record: its collectives, its step, what it was doing, its error
    rank<R>.stack.txt    its threads' Python stacks, from the watch thread, when it stalled
    rank<R>.fatal.txt    its stacks when it died at once (faulthandler: gloo's abort, a segfault)
    rank<R>.last.txt     what it was doing (its last mark), and its stacks if its launcher ended it
                         (torchrun's SIGTERM once another rank failed); gone when its run ended
    diagnosis.txt        the one line

A rank with a last.txt and no stacks in it, and no record, was killed outright (SIGKILL: the OOM killer).
"""

from __future__ import annotations

import json
from pathlib import Path

from parallel.judge.hangs import diagnose
from parallel.loop.results import atomic_write
from parallel.world.errors import ConfigError


def read(folder: Path) -> dict[int, dict]:
    """Every rank's record in `folder`, by rank ({} when there is none)."""
    out = {}
    for p in sorted(folder.glob("rank*.json")) if folder.is_dir() else []:
        try:
            record = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        out[int(record["rank"])] = record
    return out


def _texts(folder: Path, kind: str) -> dict[int, str]:
    """rank<R>.<kind>.txt's text, by rank, where it says anything."""
    found = {int(p.name[4:].split(".")[0]): p.read_text(errors="replace")
             for p in (sorted(folder.glob(f"rank*.{kind}.txt")) if folder.is_dir() else [])}
    return {rank: text for rank, text in found.items() if text.strip()}


def stacks(folder: Path) -> dict[int, str]:
    """The Python stacks faulthandler wrote (recorder.py) for the ranks that died at once, by rank."""
    return _texts(folder, "fatal")


def last(folder: Path) -> dict[int, tuple[str, str]]:
    """Each rank's last mark, (what it was doing, the stacks its launcher's SIGTERM wrote after it or "")."""
    out = {}
    for rank, text in _texts(folder, "last").items():
        doing, _, rest = text.partition("\n")
        out[rank] = (doing.strip(), rest if rest.strip() else "")
    return out


def explain(folder: Path, world: int, log: str = "") -> str | None:
    """Diagnose the records in `folder` and keep the line beside them (diagnosis.txt); None without records.
    `log`: the run's output (a dying gloo rank's last words go there, not to its record)."""
    for p in folder.glob("rank*.fatal.txt"):  # empty: its rank ended by a signal faulthandler leaves alone
        if p.stat().st_size == 0:
            p.unlink()
    line = diagnose(read(folder), world, stacks(folder), log, last(folder))
    if line is not None:
        atomic_write(folder / "diagnosis.txt", line + "\n")
    return line


def add_parser(sub) -> None:
    p = sub.add_parser("diagnose", help="where the ranks of a hung or failed run parted, from their records")
    p.add_argument("folder", metavar="DIR", help="the ranks' records: OUT/hang/<run>/ (the harness's), or "
                                                 "results/hang/<strategy>/ (a script's under a plain torchrun)")
    p.add_argument("--world", type=int, default=0, help="ranks in the run (default: the records' highest + 1)")
    p.add_argument("--log", default="", metavar="FILE", help="the run's output, where a dying rank's last words are")


def main(args, console) -> int:
    """`python -m parallel diagnose DIR`: the one line, then each rank's state and where its record is."""
    folder = Path(args.folder)
    records, fatal, marks = read(folder), stacks(folder), last(folder)
    if not records and not fatal and not marks:
        raise ConfigError(f"{folder}: no rank's record here (rank<R>.json, written when a run fails or stalls)")
    world = args.world or max([*records, *fatal, *marks]) + 1
    log = Path(args.log).read_text(errors="replace") if args.log else ""
    console.print(explain(folder, world, log), markup=False, highlight=False)
    for rank in range(world):
        rec = records.get(rank)
        what = (f"{rec['doing']}; {len(rec['entries'])} collectives recorded; {rec['error'] or 'no error'}"
                if rec else f"died at once (rank{rank}.fatal.txt)" if rank in fatal else
                f"{marks[rank][0]}; {'ended by its launcher' if marks[rank][1] else 'killed'} (rank{rank}.last.txt)"
                if rank in marks else "no record")
        console.print(f"  rank {rank}: {what}", markup=False, highlight=False)
    console.print(f"each rank's collectives, one a line, to diff: {folder}/rank<R>.txt", markup=False)
    return 0
