"""Errors as the user reads them: bad input (ConfigError: the CLI prints its message as one line and exits
2), and a rank's failure as one line, read for whether a collective caused it (error_line, from_a_collective)."""

from __future__ import annotations

import re
import site
import sys
import sysconfig
import traceback
from collections.abc import Iterable
from pathlib import Path


class ConfigError(ValueError):
    """Bad input, found before any work starts. The message names every number involved."""


class CheckFailed(ConfigError):
    """A strategy's check raised in the user's model's code, on the meta device and on a real copy alike:
    the comparison skips that strategy with this line, even where the user named it (compare.select_runs)."""


class CheckBroken(ConfigError):
    """A strategy's check raised in this project's code on a user's model, on the meta device and on a real
    copy alike: a bug of ours. Under `all` the strategy is skipped with this line; named, it is an error."""


PACKAGE = Path(sys.modules[__name__.partition(".")[0]].__file__).resolve().parent  # parallel/
_LIBRARIES = tuple({Path(p).resolve() for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"],
                                                sysconfig.get_paths()["stdlib"], sys.base_prefix, sys.prefix,
                                                site.getusersitepackages(), *site.getsitepackages())})
_INSTALLED = {"site-packages", "dist-packages"}  # any such folder holds libraries (pip --user, --target)
REPORT = ("this is a bug in parallel, not in your model or data: please report it with the traceback above and "
          "`python -m parallel devices` (docs/debugging.md#an-internal-error)")


def raised_in(error: BaseException, theirs: Iterable[str] = ()) -> str:
    """Where the user's code raised `error`: "FILE:LINE" of the deepest frame of its traceback that is the
    user's, when no frame of this project's lies deeper; "" where ours raised it (or nothing of theirs ran).
    The user's: a file in `theirs` (their model's classes, which may live in a library: transformers'), or
    any file outside this package and the installed libraries (their factory, their data code). Library
    frames in between (torch's, numpy's) belong to whoever called them."""
    named = {str(Path(f).resolve()) for f in theirs if f}
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = Path(frame.filename).resolve()
        if str(path) in named:
            return f"{frame.filename}:{frame.lineno}"
        if path.is_relative_to(PACKAGE):
            return ""
        library = any(path.is_relative_to(lib) for lib in _LIBRARIES) or bool(_INSTALLED & set(path.parts))
        if not frame.filename.startswith("<") and not library:
            return f"{frame.filename}:{frame.lineno}"
    return ""


def theirs_line(error: BaseException, theirs: Iterable[str] = ()) -> str:
    """`Type: its first line`, with " (at FILE:LINE)" where the user's code raised it (raised_in)."""
    where = raised_in(error, theirs)
    return f"{first_line(error)} (at {where})" if where else first_line(error)


def first_line(error: BaseException) -> str:
    """`Type: its first line`, or `Type` for an error that says nothing."""
    return _line(error, 0)


def last_line(error: BaseException) -> str:
    """`Type: its last line` (a kernel's refusal is at the end of its message)."""
    return _line(error, -1)


def _line(error: BaseException, which: int) -> str:
    text = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return f"{type(error).__name__}: {text[which]}" if text else type(error).__name__


THEIRS = "[your code] "  # a child's stderr line naming an error the user's code raised (launch/child.py reads it)


def error_line(error: BaseException, theirs: Iterable[str] = ()) -> str:
    """`Type: its first line`: an error as one line (a collective's error runs to a dozen), with where the
    user's code raised it (theirs_line). One raised from a collective's failure (torch's pipelining wraps a
    stage's: "Failed to run stage backward") carries it after "from" instead, so that the run is diagnosed
    as the hang it is, not as the rank's own crash."""
    line, cause = first_line(error), error.__cause__ or error.__context__
    for _ in range(8):  # a chain of causes, not a cycle
        if cause is not None and from_a_collective(inner := first_line(cause)):
            return f"{line} (from {inner})" if line != inner else line
        cause = cause and (cause.__cause__ or cause.__context__)
    return theirs_line(error, theirs)


# "pair closure": gloo's own words when a pair's timeout closes it ("Application timeout caused pair
# closure"), which DDP's comm hook passes on as "Got the following error when running the callback: ...".
_COLLECTIVE_ERRORS = ("gloo", "NCCL", "Timed out", "timed out", "Connection reset", "Connection closed",
                      "pair closure", "monitoredBarrier", "Detected mismatch between collectives")
_DIST_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError")
WATCH_ENDED = "ended by its watch thread"  # a wait torch did not bound, ended by recorder.py's thread


def from_a_collective(error: str) -> bool:
    """Does this error ("RuntimeError: ...", or torchrun's "rank 1: RuntimeError: ...") come from a
    collective (its timeout, a peer gone, torch's check), not from the rank's own code?"""
    error = re.sub(r"^rank \d+: ", "", error)
    return error.startswith(_DIST_ERRORS) or WATCH_ENDED in error or (
        error.startswith("RuntimeError") and any(word in error for word in _COLLECTIVE_ERRORS))
