"""Pipeline schedules. The in-process pipeline's: the order in which one stage runs its micro-batches'
forward (F) and backward (B) pieces. torch.distributed.pipelining's (pipeline_dist, fsdp_pp): which of its
classes, the stages each rank holds and where, and what a torch release lacks to run one."""

from __future__ import annotations

import torch


def gpipe(s: int, p: int, m: int) -> list[tuple[str, int]]:
    """Every forward, then every backward, last micro-batch first."""
    return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]


def one_f_one_b(s: int, p: int, m: int) -> list[tuple[str, int]]:
    """Warm-up: p-1-s forwards; steady state: one forward, one backward; cool-down: the backwards left."""
    warm = min(p - 1 - s, m)
    ops = [("F", j) for j in range(warm)]
    for j in range(warm, m):
        ops += [("F", j), ("B", j - warm)]
    return ops + [("B", j) for j in range(m - warm, m)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


# name -> (torch's schedule class, stages per rank, placement of stage i: "loop" rank i % p, "v": stage_ids)
TORCH = {"gpipe": ("ScheduleGPipe", 1, "loop"), "1f1b": ("Schedule1F1B", 1, "loop"),
         "interleaved1f1b": ("ScheduleInterleaved1F1B", 2, "loop"), "loopedbfs": ("ScheduleLoopedBFS", 2, "loop"),
         "interleavedzb": ("ScheduleInterleavedZeroBubble", 2, "loop"), "zbv": ("ScheduleZBVZeroBubble", 2, "v"),
         "dualpipev": ("ScheduleDualPipeV", 2, "v")}


def stage_ids(rank: int, p: int, v: int, placement: str) -> list[int]:
    """The stages rank `rank` holds, of p x v: a loop (r, r + p, r + 2p, ...) or a V (r, 2p - 1 - r)."""
    return [rank, 2 * p - 1 - rank] if placement == "v" else [rank + i * p for i in range(v)]


def least_microbatches(schedule: str, p: int) -> int:
    """The fewest micro-batches torch runs `schedule` on over p ranks: DualPipeV's 2p (one per stage)."""
    return 2 * p if schedule == "dualpipev" else 1


def torch_lacks(name: str, backend: str = "gloo") -> str | None:
    """Why this torch cannot run schedule `name` as written here over `backend`, or None: older releases
    lack a schedule or the scale_grads switch the batch mean relies on; and before the warm-up vote
    (PipelineStage._warmup_forward_vote, torch 2.13), a V schedule's first step sends from a rank to itself
    (its two middle stages), which gloo refuses: "Pair is not connected" (seen on torch 2.11). pyproject
    allows torch 2.11; 2.11 and 2.13 are tested."""
    import inspect

    import torch.distributed.pipelining.schedules as schedules
    from torch.distributed.pipelining import PipelineStage

    cls = getattr(schedules, name, None)
    if cls is None or "scale_grads" not in inspect.signature(cls.__init__).parameters:
        return (f"needs torch.distributed.pipelining's {name} with scale_grads, which torch "
                f"{torch.__version__} lacks (tested on 2.13)")
    v_shaped = any(layout == "v" for cls_name, _, layout in TORCH.values() if cls_name == name)
    if v_shaped and backend == "gloo" and not hasattr(PipelineStage, "_warmup_forward_vote"):
        return (f"{name} on gloo needs torch 2.13 or newer: torch {torch.__version__}'s pipelining starts a V "
                "schedule by sending from a rank to itself, which gloo refuses ('Pair is not connected')")
    return None
