"""The style of every table the package prints (the report's, the planner's): rich, no vertical rules;
a number's cell ("-" where there is none), a size in bytes, the busiest rank's figure."""

from __future__ import annotations

from rich import box
from rich.table import Table


def num(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def size(n, short: bool = False) -> str:
    """Bytes to three significant digits for a person: 402 MiB, 64.4 KiB, 1.50 MiB (short: 1.5M); None is '-'."""
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1000 or unit == "TiB":
            text = f"{n:.0f} {unit}" if unit == "B" or abs(n) >= 100 else f"{n:.3g} {unit}"
            return text.replace(" ", "").replace("iB", "") if short else text
        n /= 1024
    return str(n)


def table(title: str, heads: list[tuple[str, str]]) -> Table:
    """A report table: no vertical rules (they cost 3 columns each), cells that wrap instead of being cut."""
    t = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0),
              title_style="bold")
    for name, justify in heads:
        t.add_column(name, justify=justify, overflow="fold")
    return t


def count(n: int) -> str:
    """A count for a person: 417K, 1.2M, 3.5B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def largest(v):
    """A per-rank list's largest entry (ranks that did not measure give None; None if none did), or the
    value itself: the busiest rank's figure in a table."""
    if isinstance(v, list):
        v = [x for x in v if x is not None]
        return max(v) if v else None
    return v
