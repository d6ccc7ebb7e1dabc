"""`python -m parallel.script NAME [options]`: a strategy's own script, from the installed package. It is
what `scripts/NAME.py` runs from a clone: one strategy in this process, or in each torchrun worker.

    torchrun --nproc_per_node=2 -m parallel.script ddp --steps 20
"""

from __future__ import annotations

import sys

from parallel.cli import script_main
from parallel.cliargs import refuse
from parallel.config import ConfigError
from parallel.strategies import NAMES, get


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        return refuse(f"usage: python -m parallel.script NAME [options]; NAME is one of {', '.join(NAMES)}")
    try:
        get(argv[0])
    except ConfigError as e:
        return refuse(f"error: {e}")
    return script_main(argv[0], argv[1:])


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
