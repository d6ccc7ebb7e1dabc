"""python scripts/single.py [--workload cnn] [--devices cpu:2] [--steps 20] [--out DIR]

One device, the baseline. Same options as `python -m parallel run single`; with --out it writes the same
results.json.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("single"))
