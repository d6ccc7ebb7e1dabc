"""python scripts/model_parallel.py --devices cpu:2 [--balance time|params] [--workload cnn] [--out DIR]

The model's layers split into one stage per device, run one stage at a time. Same options as
`python -m parallel run model_parallel`; with --out it writes the same results.json (split, memory and
idle time per stage in the row's details).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("model_parallel"))
