"""Timings that cannot be right as measured, flagged instead of printed as if they were.

A figure is flagged "noisy" when
  - the physics forbids it: activation checkpointing faster than the same step without it (it recomputes
    the forward pass), a naive clock seeing more work than a synchronized one, the same work twice at
    very different speeds, a step with its loading shorter than the step alone;
  - its repeats disagree so much that the median says nothing: the median is SPREAD x the fastest repeat
    or more, so most repeats were slowed by something other than the work;
  - other processes used more than load.NOISY of the machine's CPU while it was measured (world/load.py).

Each flag is one line: what is wrong, why it cannot be, and what to do. `bench` and `sweep` mark the
flagged cells in their tables and print the lines under them; the JSON they write carries them too.
"""

from __future__ import annotations

import time

from parallel.world.load import NOISY, ForeignLoad

SPREAD = 1.5  # median / fastest repeat at or over this: most repeats were disturbed
FASTER = 1.10  # "cannot be faster" allows this much: two medians of a few repeats each differ by a few %
WINDOW_S = 1.0  # the CPU counters tick every 10 ms: over a shorter window the share of others is not known


class Watch:
    """load.ForeignLoad over a measurement, and whether it lasted long enough for its answer to mean
    something: `stop()` is the share of the CPU other processes used, or None for a window under WINDOW_S."""

    def __init__(self):
        self._start, self._load = time.monotonic(), ForeignLoad()

    def stop(self) -> float | None:
        share = self._load.stop()[0]
        return share if time.monotonic() - self._start >= WINDOW_S else None


def spread(stats: dict) -> str | None:
    """Why the median of these repeats (timing.summarize's dict) says nothing, or None."""
    p50, fastest = stats.get("p50_ms"), stats.get("min_ms")
    if not p50 or not fastest or (stats.get("n") or 0) < 2:
        return None
    if p50 >= SPREAD * fastest:
        return (f"its median ({p50:.3g} ms) is {p50 / fastest:.1f}x its fastest repeat ({fastest:.3g} ms): "
                "most repeats were slowed by something other than the work")
    return None


def busy(share: float | None) -> str | None:
    """Why a measurement taken while other processes used `share` of the CPU is suspect, or None."""
    if share is None or share <= NOISY:
        return None
    return f"other processes used {share:.0%} of the machine's CPU while it was measured"


def cannot_be_faster(slow_ms: float | None, fast_ms: float | None, than: str, why: str,
                     by: float = FASTER) -> str | None:
    """The step timed `slow_ms` cannot be faster than `than`'s, timed `fast_ms`, because `why`: the reason
    when it was, by more than `by` (the ratio), else None."""
    if not slow_ms or not fast_ms or fast_ms / slow_ms <= by:
        return None
    return f"{fast_ms / slow_ms:.2f}x faster than {than}, which cannot be: {why}"


def mark(cell: str, flagged: bool) -> str:
    """A table cell (rich markup) with the flag's marker: the reader sees which figure the note is about."""
    return f"[yellow]{cell} noisy[/]" if flagged else cell
