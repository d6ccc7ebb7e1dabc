"""Pipeline schedules. The in-process pipeline's: the order in which one stage runs its micro-batches'
forward (F) and backward (B) pieces. torch.distributed.pipelining's (pipeline_dist, fsdp_pp): which of its
classes, the stages each rank holds and where, and what a torch release lacks to run one."""

from __future__ import annotations

import dataclasses

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


@dataclasses.dataclass(frozen=True)
class Torch:
    """One of torch.distributed.pipelining's schedules as pipeline_dist runs it: a row of TORCH."""
    cls: str  # its class in torch.distributed.pipelining.schedules
    per_rank: int  # the stages a rank holds unless --stages-per-rank says more
    placement: str  # stage i on rank i % p ("loop"), or two a rank in a V (stage_ids)
    looped: bool  # it runs several stages a rank, and not one
    least: str  # the fewest micro-batches torch runs it on: "1", "p" (one a stage: 1F1B), "2p" (DualPipeV's)
    rounds: bool  # micro-batches in whole rounds of p (torch's interleaved schedules)


TORCH = {
    "gpipe": Torch("ScheduleGPipe", 1, "loop", False, "1", False),
    "1f1b": Torch("Schedule1F1B", 1, "loop", False, "p", False),
    "interleaved1f1b": Torch("ScheduleInterleaved1F1B", 2, "loop", True, "1", True),
    "loopedbfs": Torch("ScheduleLoopedBFS", 2, "loop", True, "1", False),
    "interleavedzb": Torch("ScheduleInterleavedZeroBubble", 2, "loop", True, "1", True),
    "zbv": Torch("ScheduleZBVZeroBubble", 2, "v", True, "1", False),
    "dualpipev": Torch("ScheduleDualPipeV", 2, "v", True, "2p", False),
}


def stage_ids(rank: int, p: int, v: int, placement: str) -> list[int]:
    """The stages rank `rank` holds, of p x v: a loop (r, r + p, r + 2p, ...) or a V (r, 2p - 1 - r)."""
    return [rank, 2 * p - 1 - rank] if placement == "v" else [rank + i * p for i in range(v)]


def least_microbatches(schedule: str, p: int) -> int:
    """The fewest micro-batches torch runs `schedule` on over p ranks (TORCH's `least`)."""
    return {"1": 1, "p": p, "2p": 2 * p}[TORCH[schedule].least]


def broken_rule(schedule: str, per_rank: int = 0, p: int | None = None, m: int = 1, batch: int = 1,
                layers: int = 0, holding: int = 0, what: str = "model") -> str | None:
    """The first rule of `schedule`'s row the run breaks, in one message, or None. The options' rules need
    only --stages-per-rank (`per_rank`, 0: the schedule's own); the run's need p ranks, m micro-batches of
    `batch` samples, and the model's `layers` (`holding` of them with parameters)."""
    s = TORCH[schedule]
    rules = [  # (the rule, broken, what it says)
        ("stages a rank, 0 or more", per_rank < 0,
         f"--stages-per-rank must be 0 (the schedule's own) or more, got {per_rank}"),
        ("one stage a rank", not s.looped and per_rank > 1,
         f"--schedule {schedule} runs one stage per rank, not {per_rank} (the looped schedules run several: "
         "interleaved1f1b, loopedbfs, interleavedzb)"),
        ("several stages a rank", s.looped and per_rank == 1,
         f"--schedule {schedule} loops over several stages per rank: --stages-per-rank 1 is gpipe or 1f1b"),
        ("two a rank in a V", s.placement == "v" and per_rank not in (0, 2),
         f"--schedule {schedule} places its stages in a V, exactly 2 per rank; --stages-per-rank {per_rank} would "
         f"make {per_rank} per rank")]
    if p is not None:
        v, least = per_rank or s.per_rank, least_microbatches(schedule, p)
        fewest = (f"--schedule {schedule} needs at least as many micro-batches as stages: {m} < {p}" if s.least == "p"
                  else f"--schedule {schedule} needs at least as many micro-batches as its {least} stages (2 on each "
                       f"of {p} ranks): --microbatches {m}")
        rules += [
            ("micro-batches divide the batch", m > batch or batch % m,
             f"--microbatches {m} must divide the {batch} samples each pipeline takes a step: torch's stages "
             "receive into buffers shaped like one micro-batch"),
            ("two ranks or more", p < 2, f"a pipeline needs at least 2 processes (one stage each), got {p}"),
            ("a layer a stage", p * v > layers,
             f"--schedule {schedule} runs {v} stage(s) on each of {p} ranks, {p * v} stages, but the {what} has "
             f"{layers} layers to split"),
            ("parameters in every stage", p * v > holding,
             f"{p * v} stages, but only {holding} of the {what}'s layers have parameters: a stage without any has "
             "nothing to train (fewer ranks, or --stages-per-rank 1)"),
            ("the fewest micro-batches", m < least, fewest),
            ("whole rounds", s.rounds and m % max(1, m // p),
             f"--schedule {schedule} runs micro-batches in rounds of {p}: --microbatches {m} is not a multiple of "
             f"its {max(1, m // p)} rounds")]
    return next((said for _, broken, said in rules if broken), None)


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
    v_shaped = any(row.placement == "v" for row in TORCH.values() if row.cls == name)
    if v_shaped and backend == "gloo" and not hasattr(PipelineStage, "_warmup_forward_vote"):
        return (f"{name} on gloo needs torch 2.13 or newer: torch {torch.__version__}'s pipelining starts a V "
                "schedule by sending from a rank to itself, which gloo refuses ('Pair is not connected')")
    return None
