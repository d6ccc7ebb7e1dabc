"""python scripts/hogwild.py --workers 2 [--workload cnn] [--steps 20] [--out DIR]

Hogwild: W processes train the same parameters in shared memory with no locks. Same options as
`python -m parallel run hogwild`; with --out it writes the same results.json, with staleness figures.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("hogwild"))
