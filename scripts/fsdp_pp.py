"""torchrun --nproc_per_node=4 scripts/fsdp_pp.py --workload transformer --pp 2 --schedule 1f1b

Pipeline parallelism across pp ranks composed with FSDP2 across the dp ranks of each stage: on cpu:4 with
--pp 2, stage 0 is sharded over ranks 0 and 1, stage 1 over ranks 2 and 3, and each of the two pipelines
trains on half of the batch. Same schedules as pipeline_dist. Same options as
`python -m parallel run fsdp_pp`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp_pp"))
