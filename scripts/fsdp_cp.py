"""torchrun --nproc_per_node=4 scripts/fsdp_cp.py --workload transformer --seq-len 256 [--cp 2] [--out DIR]

Context parallelism with FSDP2: the ring attention of scripts/context_parallel.py, the model
sharded over all dp x cp ranks as one group.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/fsdp_cp.py` runs it as a world of one. Same options as `python -m parallel run fsdp_cp`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp_cp"))
