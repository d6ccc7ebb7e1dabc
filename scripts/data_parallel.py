"""python scripts/data_parallel.py --devices cuda:0,1 [--workload cnn] [--steps 20] [--out DIR]

torch's nn.DataParallel. With no GPU it is a pass-through (it just calls the module), and the row says
so. Same options as `python -m parallel run data_parallel`; with --out it writes the same results.json.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("data_parallel"))
