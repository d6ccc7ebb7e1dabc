"""A hang or a timeout, named: which rank, which collective, which step (the ranks' records: recorder.py).

When a multi-process run fails or times out, each rank has written its record of collectives to
OUT/hang/<run>/ (on its error, or from its watch thread once it stalled). The parent reads them all and
says in one line where the ranks parted. In every process group, collectives are matched by their
sequence number: the n-th collective of a group is the same call on every member, or the job is broken.
So the first sequence number at which the members disagree is the cause:

    rank 1 is at collective #37 all_gather(512 fp32) on group [0, 1]; rank 0 waits in #37
        all_reduce(1024 fp32) (step 3): the ranks issued different collectives
    rank 1 never issued collective #12 on group [0, 1] (its last: #11 broadcast(..)); rank 0 waits in #12
        all_reduce(..) (step 1): rank 1 is 1 collective behind; it was: step 1: in its train_step
    rank 1 left no record: it died or was killed before it could write one (its log says which)

The same analysis as torch's fr_trace tool (torch.distributed.flight_recorder), on the project's own
record, which also knows each collective's training step and what each rank was doing.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from pathlib import Path

from parallel.loop.recorder import DTYPES, describe
from parallel.world.errors import from_a_collective

_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<fn>\w+)')
# The project's dispatch modes see every op from inside it (the byte counter of the counted steps, --hang-rank's
# stop): the line that issued a collective is the first frame below them.
_SEES_EVERY_OP = ("/parallel/wire.py", "/parallel/faults.py")


def _died_in(stack: str) -> str:
    """Where a fatal stack's main thread was, and its first line (faulthandler's: "Fatal Python error: ...")."""
    first = stack.strip().splitlines()[0] if stack.strip() else "died"
    return f"{_place(stack)}; {first}"


def _place(stack: str) -> str:
    """Where a fatal stack's main thread was: the torch.distributed call and the project's line under it."""
    threads = [t for t in stack.split("\n\n") if _FRAME.search(t)]  # faulthandler: a block a thread
    main = next((t for t in threads if "torch/distributed" in t), next((t for t in threads if "Current thread" in t),
                                                                       threads[-1] if threads else ""))
    frames = [m.groupdict() for m in _FRAME.finditer(main)]  # most recent first
    call = next((f["fn"] for f in frames if "torch/distributed" in f["path"] and f["fn"] != "wrapper"), None)
    ours = next((f for f in frames if "/parallel/" in f["path"] and not f["path"].endswith(_SEES_EVERY_OP)), None)
    line = f"{Path(ours['path']).name}:{ours['line']} {ours['fn']}" if ours else ""
    if call:
        return f"inside {call}" + (f" (from {line})" if line else "")
    return f"at {line}" if line else "with no Python frame of its own"  # in C++: a Work's wait, say


_WHAT = re.compile(r"what\(\):\s*(.*)")


def _dead(records: dict[int, dict], stacks: dict[int, str], log: str) -> str | None:
    """Ranks that died at once beside ranks that wait: where each died, and what the others wait in."""
    dead = sorted(r for r in stacks if r not in records)
    if not dead:
        return None
    r = dead[0]
    waits = [(q, e) for q, rec in sorted(records.items()) for e in _open(rec)]
    what = _WHAT.search(log)
    said = f" ({what.group(1).split('] ', 1)[-1][:160]})" if what else ""
    line = f"rank {r} died {_died_in(stacks[r])}{said}"
    for other in dead[1:]:  # gloo aborts every rank that receives more than it expects: often two
        line += f"; rank {other} died too, {_place(stacks[other])}"
    if waits:
        q, e = waits[0]
        group = _group_text(records[q]["groups"].get(e["group"], []))
        line += f"; rank {q} waits in #{e['seq']} {describe(e)} on group {group}{_where(e)}, which rank {r} never ended"
    return line


_UNEVEN = re.compile(r"all_?to_?all|^scatter|^gather")  # sizes that differ between ranks by design


def _fingerprint(e: dict) -> tuple:
    """What every member of a group must pass alike: the op, and the dtype and the shapes but where an op's
    parts differ by rank by design: an all-to-all's splits; a scatter's or a gather's root passes the
    tensors that the other ranks do not (their record has no sizes and no dtype), so for those the op."""
    if _UNEVEN.search(e["op"]):
        return (e["op"],)
    return e["op"], tuple(map(tuple, e["sizes"])), e["dtype"]


def _open(record: dict) -> list[dict]:
    """The collectives a rank's record holds unfinished (it waits in them, or failed in them), oldest first;
    point-to-point ones aside (gloo's recorder does not number them)."""
    return [e for e in record["entries"] if e["state"] != "finished" and not e["p2p"]]


def _step_text(step: int) -> str:
    return f"step {step}" if step >= 0 else "setting up"


def _where(e: dict) -> str:
    return f" ({_step_text(e['step'])})"


def _group_text(ranks: list[int]) -> str:
    return "[" + ", ".join(map(str, ranks)) + "]"


def _disagreements(records: dict[int, dict]) -> list[tuple[int, str]]:
    """(time of the earliest collective involved, the line) for the first disagreement of every group, the
    root first: a rank behind in one group because it waits in another's collective (fsdp_pp: rank 3 behind
    its pipeline partner while it waits for the stopped rank 1 in their FSDP group) follows from that one,
    whichever was issued first."""
    groups: dict[str, list[int]] = {}
    for r in records.values():
        groups.update(r.get("groups", {}))
    found = []
    for name, members in groups.items():
        have = [m for m in members if m in records]
        if len(have) < 2:
            continue
        seqs = {m: {e["seq"]: e for e in records[m]["entries"] if e["group"] == name and not e["p2p"]} for m in have}
        enqueued = {m: int(records[m].get("status", {}).get(name, {}).get("last_enqueued_collective", -1))
                    for m in have}
        last = {m: max(seqs[m], default=0) for m in have}
        oldest = max(min(seqs[m], default=0) for m in have)  # below it a ring may have forgotten
        for n in range(max(1, oldest), max(last.values()) + 1):
            at = {m: seqs[m].get(n) for m in have}
            # a member whose ring forgot #n (one ring for every group) got past it if torch's status says so
            forgot = [m for m in have if at[m] is None and not seqs[m] and enqueued[m] >= n]
            have_n = [m for m in have if m not in forgot]
            at = {m: at[m] for m in have_n}
            issued = [m for m in have_n if at[m] is not None]
            prints = {_fingerprint(at[m]) for m in issued}
            if not issued or (len(issued) == len(have_n) and len(prints) == 1):
                continue  # agreed, or a number no record holds (a monitored barrier takes one, unrecorded)
            behind = [m for m in have_n if at[m] is None]
            waits = bool(behind) and bool(_open(records[behind[0]]))
            found.append((waits, min(at[m]["time_ns"] for m in issued), _line(name, members, n, at, records, seqs)))
            break
    return [(t, line) for _, t, line in sorted(found)]


def _line(name: str, members: list[int], n: int, at: dict, records: dict, seqs: dict) -> str:
    group = _group_text(members)
    issued = [m for m in at if at[m] is not None]
    # the rank named as waiting issued what most did (ties: the lowest rank's), so the odd one out is named as such
    common = Counter(_fingerprint(at[m]) for m in issued).most_common(1)[0][0]
    waiting = next(m for m in issued if _fingerprint(at[m]) == common)
    e = at[waiting]
    behind = [m for m in at if at[m] is None]
    if not behind:  # every member issued #n, not the same one
        other = next(m for m in issued if _fingerprint(at[m]) != common)
        return (f"rank {other} is at collective #{n} {describe(at[other])} on group {group}; rank {waiting} waits "
                f"in #{n} {describe(e)}{_where(e)}: the ranks issued different collectives")
    b = behind[0]
    mine = seqs[b]
    last = max(mine, default=0)
    its_last = f" (its last: #{last} {describe(mine[last])})" if last else " (it issued none on this group)"
    ahead = f"rank {issued[0]}" if len(issued) == 1 else f"ranks {', '.join(map(str, issued))}"
    verb = "waits" if len(issued) == 1 else "wait"
    gap = sum(1 for m in issued[:1] for k in seqs[m] if last < k <= n)  # recorded ones: a barrier takes a number
    odd = [m for m in issued if _fingerprint(at[m]) != common]
    also = f"; rank {odd[0]} issued #{n} {describe(at[odd[0]])}, not the same" if odd else ""
    return (f"rank {b} never issued collective #{n} on group {group}{its_last}; {ahead} {verb} in #{n} "
            f"{describe(e)}{_where(e)}: rank {b} is {gap} collective{'s' * (gap != 1)} behind; "
            f"it was: {records[b]['doing']}{also}")


def _failed(records: dict[int, dict]) -> str | None:
    """A rank whose collective failed where the records cannot say which (gloo's point-to-point sends and
    receives are not in its Flight Recorder): the error, the step, where its stack was; what the others did."""
    failed = [r for r, rec in sorted(records.items()) if rec["error"] and from_a_collective(rec["error"])]
    if not failed:
        return None
    r = failed[0]
    rec = records[r]
    stack = rec.get("stack", "")  # where its error was raised
    where = f" {_place(stack)}" if stack else ""
    step = _step_text(rec["step"])
    others = "; ".join(f"rank {q} was: {records[q]['doing']}" for q in sorted(records) if q != r)
    inside = _open(rec)  # the collective it was in
    if inside:
        e = inside[-1]
        step = f"#{e['seq']} {describe(e)} on group {_group_text(rec['groups'].get(e['group'], []))}{_where(e)}"
    line = f"rank {r} failed {'in' if inside else 'at'} {step}{where}: {rec['error']}"
    return line + (f"; {others}" if others else "")


_PRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), OpType=(\w+), "
                    r"TensorShape=(\[[^\]]*\]), TensorDtypes=(\w+)")


def _fingerprints(records: dict[int, dict]) -> str | None:
    """torch's own check (--debug-collectives: TORCH_DISTRIBUTED_DEBUG=DETAIL) raised on a mismatch before
    the collective ran: its two fingerprints, in the diagnosis's words."""
    for _, rec in sorted(records.items()):
        found = _PRINT.findall(rec["error"] or "")
        if len(found) == 2:
            (a, n_a, *print_a), (b, n_b, *print_b) = found
            return (f"rank {b} is at collective #{n_b} {_torch_print(*print_b)}; rank {a} at #{n_a} "
                    f"{_torch_print(*print_a)} ({_step_text(rec['step'])}): the ranks issued different "
                    f"collectives (torch's check, --debug-collectives)")
    return None


def _torch_print(op: str, shape: str, dtype: str) -> str:
    """CollectiveFingerPrint's ALLREDUCE, [4, 8], Float as the records write it: all_reduce(32 fp32)."""
    numel = math.prod(int(d) for d in shape.strip("[]").split(",") if d.strip())
    name = {"ALLREDUCE": "all_reduce", "ALLGATHER": "all_gather", "_ALLGATHER_BASE": "all_gather",
            "REDUCE_SCATTER": "reduce_scatter", "_REDUCE_SCATTER_BASE": "reduce_scatter"}.get(op, op.lower())
    return f"{name}({numel} {DTYPES.get(dtype, dtype)})"


def _left_waiting(records: dict[int, dict], missing: list[int]) -> str | None:
    """The first collective a rank was in, unfinished, on a group with a rank that left no record."""
    for q, rec in sorted(records.items()):
        for e in _open(rec):
            members = rec["groups"].get(e["group"], [])
            if gone := [m for m in missing if m in members]:
                return (f"rank {q} waited in #{e['seq']} {describe(e)} on group {_group_text(members)}{_where(e)}, "
                        f"which rank {gone[0]} never joined")
    return None


def _killed(missing: list[int], records: dict[int, dict], last: dict[int, tuple[str, str]]) -> str:
    """Ranks that left no record: what the first was doing (its last mark), the lowest step of the others."""
    steps = {r: rec["step"] for r, rec in sorted(records.items()) if "step" in rec}
    steps |= {r: int(m[1]) for r, (doing, _) in last.items() if r not in missing and r not in records
              and (m := re.match(r"step (\d+):", doing))}
    during = f", while the others were in {_step_text(min(steps.values()))}" if steps else ""
    if ahead := [r for r, s in sorted(steps.items()) if s > min(steps.values())]:  # done with their part of it
        during += f" (rank{'s' * (len(ahead) > 1)} {', '.join(map(str, ahead))} already in " \
                  f"{_step_text(max(steps.values()))})"
    was = f" (it was: {last[missing[0]][0]})" if last.get(missing[0], ("", ""))[0] else ""
    return (f"rank{'s' * (len(missing) > 1)} {', '.join(map(str, missing))} left no record: died or killed before "
            f"writing one{was}{during} (its log says which)")


def diagnose(records: dict[int, dict], world: int, stacks: dict[int, str] | None = None, log: str = "",
             last: dict[int, tuple[str, str]] | None = None) -> str | None:
    """One line: where the ranks parted, else which rank died where, else who left no record, else what
    each was doing. `stacks`: the fatal stacks of ranks that died at once; `log`: the run's output;
    `last`: each rank's last mark (what it was doing) and the stacks its launcher's SIGTERM wrote, if any."""
    last = last or {}
    if not records and not stacks and not last:
        return None
    own = [(r, rec) for r, rec in sorted(records.items()) if rec["error"] and not from_a_collective(rec["error"])]
    if own:  # a rank's own error (a crash in its code): the others' failures follow from it
        r, rec = own[0]
        return f"rank {r}: {rec['error']} ({_step_text(rec['step'])}; the others then waited for it)"
    if checked := _fingerprints(records):
        return checked
    parted, died, failed = _disagreements(records), _dead(records, stacks or {}, log), _failed(records)
    ended = {r: stack for r, (_, stack) in last.items() if stack and r not in records}
    missing = [r for r in range(world) if r not in records and r not in (stacks or {}) and r not in ended]
    if missing:  # killed (a signal faulthandler does not catch): what the others then did follows from it
        then = failed or _left_waiting(records, missing) or (parted[0][1] if parted else died)
        if not then and ended:  # none wrote a record before its launcher ended it: where the first one was
            q, more = min(ended), len(ended) > 1
            then = (f"ranks {', '.join(map(str, sorted(ended)))} were ended by their launcher (rank {q} "
                    f"{_place(ended[q])})" if more else f"rank {q} was ended by its launcher {_place(ended[q])}")
        return _killed(missing, records, last) + (f"; then {then}" if then else
                                                  "; the others agree on every collective")
    if parted:
        return parted[0][1]
    if died:
        return died
    if failed:
        return failed
    unfinished = [(r, e) for r, rec in sorted(records.items()) for e in _open(rec)]
    if unfinished:
        r, e = unfinished[0]
        return (f"every rank issued the same collectives; rank {r} waits in #{e['seq']} {describe(e)}{_where(e)}, "
                f"which every member issued: the transport, not the order")
    doing = "; ".join(f"rank {r}: {rec['doing']}" for r, rec in sorted(records.items()))
    return f"no collective is waiting and the ranks agree on every one: the hang is outside them ({doing})"
