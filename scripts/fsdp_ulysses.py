"""torchrun --nproc_per_node=4 scripts/fsdp_ulysses.py --workload transformer --seq-len 256 [--ring 2] [--out DIR]

Ulysses with FSDP2: the all-to-all attention of scripts/ulysses.py, the model
sharded over all dp x cp ranks as one group.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/fsdp_ulysses.py` runs it as a world of one. Same options as `python -m parallel run fsdp_ulysses`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp_ulysses"))
