"""torchrun --nproc_per_node=2 scripts/context_parallel.py --workload transformer --seq-len 256 \
    [--cp-layout contiguous|zigzag] [--cp-comm ring|allgather] [--cp C] [--out DIR]

Context parallelism by hand: every sequence split between the ranks, ring attention in every
block (the backward carries dK,dV home), gradients averaged over all ranks.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/context_parallel.py` runs it as a world of one. Same options as
`python -m parallel run context_parallel`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("context_parallel"))
