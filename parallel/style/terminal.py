"""The terminal every command prints to: its console (100 columns where the output is not a terminal) and
its progress bar."""

from __future__ import annotations

import os

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

WIDTH = 100  # the report's width when the output is not a terminal (a pipe, a file, CI's log)


def make_console(wide: bool = False) -> Console:
    """A terminal's own width (or $COLUMNS); when written to a file or a pipe, 100 columns (`--wide`: 200)."""
    console = Console()
    if console.is_terminal:
        return console
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdigit() and int(columns) > 0 else 2 * WIDTH if wide else WIDTH)


def make_progress(console: Console | None = None) -> Progress:
    """The progress bar of every long command: what runs now, done/total, time elapsed."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(), console=console)
