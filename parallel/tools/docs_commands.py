"""Every `compare --model ...` command README.md and docs/your-model.md show, run as a user types it, whole.

    python -m parallel.tools.docs_commands [--root .] [--only TEXT] [--json FILE]   (in a clone of the repository)

Each runs in a fresh process (`python -m parallel compare ...`, every strategy, every step, the report),
in a folder of its own: its exit status, wall time, how many rows matched, were left out or failed, and
whether a traceback reached the terminal. A command naming a file the repository does not hold
(my_model.py) is the reader's own and is not run. The suite runs the same commands through the same
parent with only the baseline trained (tests/test_docs_commands.py): this is the whole of each.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.table import Table

from parallel.loop.results import atomic_write
from parallel.style.terminal import make_console

DOCS = ("README.md", "docs/your-model.md")
COMMAND = re.compile(r"(?:\./launch\.sh|python -m parallel) (compare --model (?:(?!\./launch|python -m)[^`#\n])+)")


def commands(root: Path) -> list[str]:
    """Each distinct `compare --model ...` of the docs (in code blocks a line each; inline, wrapped lines
    joined), without `./launch.sh`, whose model file the repository holds."""
    found = []
    for doc in DOCS:
        text = (root / doc).read_text()
        fenced = re.findall(r"```\w*\n(.*?)```", text, re.S)
        inline = re.findall(r"`([^`]+)`", re.sub(r"```\w*\n.*?```", "", text, flags=re.S))
        for line in [*(m for block in fenced for m in COMMAND.findall(block)),
                     *(m for span in inline for m in COMMAND.findall(" ".join(span.split())))]:
            line = line.strip().rstrip("\\").strip()
            path = shlex.split(line)[2].split(":")[0]
            if (root / path).exists() and line not in found:
                found.append(line)
    return found


def run(line: str, root: Path, out: Path, timeout: float = 1800) -> dict:
    start = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "parallel", *shlex.split(line), "--out", str(out)], cwd=root,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:  # SIGTERM: compare ends the children it started, as on Ctrl-C
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        stderr += f"\ntimed out after {timeout:.0f} s"
    p = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    seconds = time.monotonic() - start
    results = out / "results.json"
    rows = json.loads(results.read_text())["rows"] if results.exists() else []
    verdicts = [r["equivalence"]["verdict"] for r in rows if r["status"] == "ok"]
    return {"command": line, "exit": p.returncode, "seconds": round(seconds, 1), "rows": len(rows),
            "matched": sum(v in ("baseline", "match") for v in verdicts), "mismatched": verdicts.count("mismatch"),
            "failed": sum(r["status"] != "ok" for r in rows),
            "left_out": len(json.loads(results.read_text())["skipped"]) if results.exists() else 0,
            "traceback": "Traceback" in p.stdout + p.stderr, "last_line": (p.stderr.strip() or " ").splitlines()[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.docs_commands", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--root", default=".", help="the clone whose README.md and docs/ are read, and run in")
    p.add_argument("--only", default="", help="run only the commands containing this text")
    p.add_argument("--json", default="", help="also write the outcomes to this file")
    args = p.parse_args(argv)
    console, outcomes = make_console(), []
    table = Table("command", "exit", "s", "rows", "match", "mismatch", "failed", "left out", "traceback")
    with tempfile.TemporaryDirectory(prefix="docs-commands-") as folder:
        for i, line in enumerate(c for c in commands(Path(args.root)) if args.only in c):
            console.print(f"[dim]{line}[/]", highlight=False)
            o = run(line, Path(args.root), Path(folder) / str(i))
            outcomes.append(o)
            table.add_row(line.removeprefix("compare --model "), str(o["exit"]), f"{o['seconds']:.0f}", str(o["rows"]),
                          str(o["matched"]), str(o["mismatched"]), str(o["failed"]), str(o["left_out"]),
                          "yes" if o["traceback"] else "no")
    console.print(table)
    if args.json:
        atomic_write(Path(args.json), json.dumps(outcomes, indent=1))
    return 0 if outcomes and all(o["exit"] == 0 and not (o["traceback"] or o["mismatched"] or o["failed"])
                                 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
