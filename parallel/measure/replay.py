"""A pipeline schedule's theory, played out from measurements: every rank's own list of actions
(`torch_orders`: torch's pipeline_order, or the order torch's one-stage schedules step) replayed on piece
times (`replay`: the dependencies between stages, the hand-offs between ranks), the micro-batches each
stage holds by the order alone (`held`), the authors' closed forms (`CLOSED_FORMS`), and what the report
shows beside a run (`pipeline_theory`). stage_time.py measures the pieces; docs/pipelines.md.
"""

from __future__ import annotations

import statistics
from collections import Counter

import torch

from parallel.kit.collectives import every_rank
from parallel.kit.schedules import one_f_one_b
from parallel.kit.stages import SentHop

Action = tuple[int, str, int]  # (stage, "F" | "I" | "B" | "W", micro-batch): one piece of a schedule


def needs(action: Action, stages: int) -> list[tuple]:
    """What must have ended before `action` starts, besides the previous action of its rank: a forward
    needs the previous stage's forward of its micro-batch; a backward (input part I, or whole B) its own
    forward and the next stage's input gradient; a weight gradient W its own I. Keys: (stage, "F" | "G"
    (input gradient made) | "W", micro-batch)."""
    s, kind, j = action
    if kind == "F":
        return [(s - 1, "F", j)] if s else []
    if kind == "W":
        return [(s, "G", j)]
    return [(s, "F", j)] + ([(s + 1, "G", j)] if s < stages - 1 else [])


def _makes(action: Action) -> list[tuple]:
    s, kind, j = action
    return [(s, "F", j)] if kind == "F" else [(s, "G", j)] if kind == "I" else \
        [(s, "W", j)] if kind == "W" else [(s, "G", j), (s, "W", j)]


def replay(orders: dict[int, list[Action]], ms: dict[tuple[int, str], float], hop: dict[int, float] | None = None,
           needs=needs, late: bool = False, groups: dict[int, list[int]] | None = None) -> list[tuple]:
    """Every rank's action list played out on piece times: rank r runs orders[r] in order, each action
    (s, kind, j) taking ms[(s, kind)] and starting once its rank is free and what it `needs` has ended,
    plus hop[b] where that crosses boundary b (between stages b and b+1; a boundary within one rank is
    left out of `hop`: free). `late`: the receiver posts its receive only when it reaches the action
    (torch's one-stage schedules), and gloo moves the data only once both ends are there, so the hand-off
    starts then, not when the sender finished. `groups[r][i]`: the index of the last action of the group
    action i of rank r runs in (DualPipeV's overlapped F&B): torch sends a group's outputs after all of
    it, so other ranks see them at its end. Returns every piece as (rank, stage, kind, micro-batch,
    start, end)."""
    hop = hop or {}
    stages = 1 + max(s for acts in orders.values() for s, _, _ in acts)
    owner = {s: r for r, acts in orders.items() for s, _, _ in acts}
    done, sent, free, at, out = {}, {}, dict.fromkeys(orders, 0.0), dict.fromkeys(orders, 0), []
    pending: dict[int, list] = {r: [] for r in orders}  # outputs made in a group not yet over
    left = sum(map(len, orders.values()))
    while left:
        moved = False
        for r, acts in orders.items():
            while at[r] < len(acts):
                action = acts[at[r]]
                deps = needs(action, stages)
                if any(d not in (done if owner.get(d[0]) == r else sent) for d in deps):
                    break
                s, kind, j = action
                start = max([free[r]] + [done[d] if owner.get(d[0]) == r else
                                         (max(sent[d], free[r]) if late else sent[d]) + hop.get(min(d[0], s), 0.0)
                                         for d in deps])
                free[r] = end = start + ms[(s, kind)]
                done.update(dict.fromkeys(_makes(action), end))
                pending[r] += _makes(action)
                if groups is None or groups[r][at[r]] == at[r]:  # the group is over: what it made goes out
                    sent.update(dict.fromkeys(pending[r], end))
                    pending[r] = []
                out.append((r, s, kind, j, start, end))
                at[r], left, moved = at[r] + 1, left - 1, True
        if not moved:
            raise ValueError("the schedule waits on itself: " + ", ".join(
                f"rank {r} at {acts[at[r]]}" for r, acts in orders.items() if at[r] < len(acts)))
    return out


def replayed(orders: dict[int, list[Action]], ms: dict[tuple[int, str], float], hop: dict[int, float] | None = None,
             late: bool = False, groups: dict[int, list[int]] | None = None) -> dict:
    """`replay`'s verdict: the schedule's span (ms, from the first piece to the last on any rank) and
    each rank's idle fraction of it (1 - its pieces' time over the span)."""
    pieces = replay(orders, ms, hop, late=late, groups=groups)
    span = max(p[5] for p in pieces)
    idle = [1 - sum(e - b for q, *_, b, e in pieces if q == r) / span for r in orders]
    return {"span_ms": span, "idle": statistics.fmean(idle), "rank_idle": idle, "pieces": pieces}


def held(orders: dict[int, list[Action]], by: str = "stage") -> dict[int, int]:
    """The most micro-batches whose activations each stage (or rank, `by`) keeps at once, by its rank's
    order alone: from a forward until that micro-batch's last backward piece (B, or W where split)."""
    now, most = Counter(), Counter()
    for r, acts in orders.items():
        for s, kind, _ in acts:
            key = s if by == "stage" else r
            now[key] += 1 if kind == "F" else -1 if kind in "BW" else 0
            most[key] = max(most[key], now[key])
    return dict(most)


# The authors' bubble of a schedule on balanced stages (per rank, in one stage's F, B = I + W, I and W;
# torch runs DualPipeV's overlapped F&B as F then B, so F&B = F + B). A rank's work is m v (F + B).
CLOSED_FORMS = {
    "gpipe": lambda p, f, b, i, w: (p - 1) * (f + b),  # GPipe, 1F1B: (p-1)(F+B) (Huang et al.; Narayanan et al.)
    "1f1b": lambda p, f, b, i, w: (p - 1) * (f + b),
    "interleaved1f1b": lambda p, f, b, i, w: (p - 1) * (f + b),  # a stage's F+B: 1/v of a rank's (Narayanan 2021)
    "loopedbfs": lambda p, f, b, i, w: (p - 1) * (f + b),
    "interleavedzb": lambda p, f, b, i, w: (p - 1) * (f + i - w),  # torch: ZB1P, i.e. ZB-H1 (Qi et al. 2024)
    "dualpipev": lambda p, f, b, i, w: (p - 1) * ((f + b) + b - 3 * w),  # (PP/2-1)(F&B+B-3W), PP = 2p stages
}


def closed_form_idle(schedule: str, p: int, m: int, v: int, ms: dict[tuple[int, str], float]) -> float | None:
    """The idle fraction a schedule's closed form gives on the mean measured piece of a stage: bubble /
    (bubble + m v (F + B)). None where no closed form applies (zbv's authors give none beyond "zero when F
    = I = W")."""
    if schedule not in CLOSED_FORMS or not ms:
        return None
    stages = sorted({s for s, _ in ms})

    def mean(kind: str) -> float:
        return statistics.fmean(ms.get((s, kind), 0.0) for s in stages)

    f, i, w = mean("F"), mean("I"), mean("W")
    b = i + w if i else mean("B")
    i, w = (i, w) if i else (b, 0.0)
    bubble = max(CLOSED_FORMS[schedule](p, f, b, i, w), 0.0)
    return bubble / (bubble + m * v * (f + b))


def pipeline_theory(orders: dict[int, list[Action]], ms: dict[tuple[int, str], float], hop: dict[int, float],
                    outside_ms: float, rank: int | None = 0, late: bool = False,
                    groups: dict[int, list[int]] | None = None) -> dict:
    """The theory beside a pipeline's measurements (details): every rank's actions replayed on the run's
    own median piece times and hand-offs (`replayed`), its idle fraction and step (rank `rank`'s replayed
    end plus `outside_ms`, the time its measured step spent outside the schedule: zero_grad, the optimiser
    step), the micro-batches each stage holds at once by the order (`held`), and the replay's pieces for
    report.html (the closed form, closed_form_idle, is the row's Measured.bubble_theory). `late`,
    `groups`: see `replay`. {} where a piece of the orders was never timed (a stage that never ran its
    backward: model_parallel's injected bug)."""
    if {(s, kind) for acts in orders.values() for s, kind, _ in acts} - ms.keys():
        return {}
    r = replayed(orders, ms, hop, late, groups)
    end = max(e for q, *_, e in r["pieces"] if rank is None or q == rank)  # None: every rank (one process)
    return {"replayed_idle": round(r["idle"], 4), "replayed_step_ms": round(end + outside_ms, 3),
            "replayed_rank_idle": [round(f, 3) for f in r["rank_idle"]],
            "held_predicted": [n for _, n in sorted(held(orders).items())],
            "piece_ms": {f"{s}{k}": round(t, 3) for (s, k), t in sorted(ms.items())},
            "hop_ms": {str(b): round(t, 3) for b, t in sorted(hop.items())},
            "replay_timeline": [[(round(b, 3), round(e, 3), f"stage {s} {k}{j}") for q, s, k, j, b, e in r["pieces"]
                                 if q == lane] for lane in orders]}


def rank_of(stage: int, p: int, placement: str) -> int:
    """The rank holding `stage` (stage_ids' inverse)."""
    return stage % p if placement == "loop" else min(stage, 2 * p - 1 - stage)


def torch_orders(schedule, name: str, p: int, m: int) -> dict[int, list]:
    """Every rank's compute actions in the order torch runs them, as (stage, "F" | "I" | "B" | "W",
    micro-batch): the runtime schedules' pipeline_order (an overlapped F&B as its two parts, in order);
    gpipe and 1f1b step without one (torch 2.13's Schedule1F1B IR even numbers the last rank's forwards
    1..m), so theirs is written out here as their _step_microbatches runs: every F then every B in
    micro-batch order; p-s forwards of warm-up then B, F pairs."""
    if name == "gpipe":
        return {r: [(r, "F", j) for j in range(m)] + [(r, "B", j) for j in range(m)] for r in range(p)}
    if name == "1f1b":

        return {r: [(r, kind, j) for kind, j in one_f_one_b(r, p, m)] for r in range(p)}
    return {r: [a for a, _ in _flat(schedule.pipeline_order[r])] for r in range(p)}


def torch_groups(schedule, name: str, p: int) -> dict[int, list[int]] | None:
    """replay's `groups` for torch's order (torch_orders): each action's group end, an overlapped F&B's
    two parts one group; None for gpipe and 1f1b."""
    if name in ("gpipe", "1f1b"):
        return None
    out = {}
    for r in range(p):
        flat = _flat(schedule.pipeline_order[r])
        out[r] = [i + left for i, (_, left) in enumerate(flat)]
    return out


def _flat(actions: list) -> list[tuple[Action, int]]:
    """torch's actions as (Action, how many parts of its group follow it), compute actions only."""
    out = []
    for a in actions:
        if a is None:
            continue
        parts = [x for x in (a.sub_actions or (a,)) if x.computation_type.value in ("F", "I", "B", "W")]
        out += [((x.stage_index, x.computation_type.value, x.microbatch_index), len(parts) - 1 - i)
                for i, x in enumerate(parts)]
    return out


def hop_ms(stage_out: dict[int, int], p: int, placement: str, dist) -> dict[int, float]:
    """Each boundary's hand-off between two ranks, measured after the run (off the clock): the sending
    rank sends one micro-batch's output bytes to the receiving rank and takes as many back (the gradient),
    SentHop's median round trip; half of it is one hand-off (ms). Boundaries within a rank (the V's turn)
    cost nothing and are left out."""
    mine = {}
    for b in range(len(stage_out) - 1):
        a, c = rank_of(b, p, placement), rank_of(b + 1, p, placement)
        if a == c or not stage_out.get(b):
            continue
        if dist.rank == a:
            hop = SentHop(c, dist.device)
            mine[b] = hop(torch.empty(stage_out[b], dtype=torch.uint8, device=dist.device)) * 1e3 / 2
            hop.close()
        elif dist.rank == c:
            SentHop.echo(a, dist.device)
    return {k: v for part in every_rank(mine) for k, v in part.items()}
