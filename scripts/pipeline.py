"""python scripts/pipeline.py --devices cpu:2 [--microbatches 4] [--schedule 1f1b|gpipe] [--balance time|params]

model_parallel's stages run as a 1F1B (or GPipe) schedule over m micro-batches, one thread per stage. Same options
as `python -m parallel run pipeline`; with --out it writes the same results.json (measured bubble beside
(p-1)/(m+p-1) in the row's details).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("pipeline"))
