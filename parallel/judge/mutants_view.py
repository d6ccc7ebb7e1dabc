"""The mutants command's tables: every injected bug with what caught it, and honest runs beside them."""

from __future__ import annotations

import itertools
import math

from rich import box
from rich.markup import escape
from rich.table import Table

from parallel.judge.named import caught
from parallel.loop.results import Equivalence


def show_mutants(outcomes: list, console) -> None:
    """A row a bug, in 100 columns: what caught it, by how much, from which step, on which tensor (each
    bug's description and run: `mutants --list`); then the diagnoses' lines, and what the old rule missed."""
    t = Table(title="injected bugs: what caught each (the oracle's mismatch, or a diagnosis naming it)",
              title_justify="left", box=box.SIMPLE_HEAD)
    for col in ("mutant", "verdict", "err / tol", "off at", "worst tensor"):
        t.add_column(col, justify="right" if col in ("err / tol", "off at") else "left",
                     no_wrap=col != "worst tensor", overflow="fold")
    for o in outcomes:
        eq = o.equivalence
        style = "green" if caught(o) else "bold red"
        t.add_row(escape(o.label), f"[{style}]{escape(eq.verdict)}[/]", _ratio(eq.ratio),
                  "-" if eq.first_step is None else str(eq.first_step), escape(_off_tensor(eq)))
    console.print(t)
    for o in outcomes:
        if o.named or o.equivalence.verdict in ("named", "unnamed"):  # the diagnosis's line, as the user sees it
            console.print(f"{o.label}: {o.named or o.equivalence.reason}", markup=False, highlight=False)
    judged = [o for o in outcomes if o.old_rule_match is not None]  # None: a hang, which no rule judges
    missed = [o.label for o in judged if o.old_rule_match]
    console.print(f"{sum(map(caught, outcomes))} of {len(outcomes)} injected bugs caught; the rule before "
                  f"per-tensor tolerances and per-step losses (one tolerance from the largest movement) missed "
                  f"{len(missed)} of the {len(judged)} the oracle judges{': ' if missed else ''}"
                  f"{', '.join(missed)}.", markup=False, highlight=False)


def show_honest(outcomes: list, bugs: list, console) -> None:
    """Per strategy and workload: the largest honest err/tol over every seed and device count, where it
    was, and the smallest err/tol among that strategy's own injected bugs: the two sides of the tolerance. A
    bug that a diagnosis names (a hang) has no err/tol: it is not one of them."""
    bugs = [o for o in bugs if o.equivalence.ratio is not None]
    t = Table(title="honest runs against injected bugs (err / tol: at most 1 is a match)", title_justify="left")
    for col in ("strategy", "workload", "runs", "largest honest", "where", "smallest bug"):
        t.add_column(col, justify="right" if col in ("runs", "largest honest", "smallest bug") else "left")
    smallest = {}
    for o in bugs:
        smallest[o.strategy] = min(smallest.get(o.strategy, math.inf), o.equivalence.ratio or 0.0)
    key = lambda o: (o.strategy, o.workload)  # noqa: E731
    for (strategy, workload), group in itertools.groupby(sorted(outcomes, key=key), key):
        group = list(group)
        worst = max(group, key=lambda o: o.equivalence.ratio or 0.0)
        style = "" if all(o.equivalence.verdict == "match" for o in group) else "bold red"
        t.add_row(escape(strategy), escape(workload), str(len(group)),
                  f"[{style}]{_ratio(worst.equivalence.ratio)}[/]" if style else _ratio(worst.equivalence.ratio),
                  escape(f"{worst.devices} seed {worst.seed} {worst.equivalence.worst_tensor}"),
                  _ratio(smallest.get(strategy)))
    console.print(t)
    worst = max(outcomes, key=lambda o: o.equivalence.ratio or 0.0)
    mismatches = sum(o.equivalence.verdict != "match" for o in outcomes)
    least = min(bugs, key=lambda o: o.equivalence.ratio or 0.0) if bugs else None
    bug = f"; the smallest injected bug to {_ratio(least.equivalence.ratio)} ({least.label})" if least else ""
    console.print(f"{len(outcomes)} honest checks, {mismatches} mismatches; the largest came to "
                  f"{_ratio(worst.equivalence.ratio)} of the tolerance ({worst.strategy} on {worst.workload}, "
                  f"{worst.devices}, seed {worst.seed}: {worst.equivalence.worst_tensor}){bug}", markup=False)


def _off_tensor(eq: Equivalence) -> str:
    """The worst tensor, where it is itself beyond its tolerance (else the loss curve caught the bug)."""
    return eq.worst_tensor if eq.tolerance and eq.max_abs_diff > eq.tolerance else "-"


def _ratio(r: float | None) -> str:
    return "-" if r is None else f"{r:.3g}"
