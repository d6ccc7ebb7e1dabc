"""The in-process pipeline's schedules: the order in which one stage runs its micro-batches' forward (F)
and backward (B) pieces."""

from __future__ import annotations


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
