"""python scripts/manual_dp.py --devices cpu:2 [--workload cnn] [--steps 20] [--out DIR]

Hand-written data parallel in one process: scatter, replicate, parallel_apply (a thread per device),
gather. Runs on cpu:N virtual devices or cuda:0,1,... Same options as `python -m parallel run manual_dp`;
with --out it writes the same results.json, with the time of each phase in the row's details.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("manual_dp"))
