"""torchrun --nproc_per_node=2 scripts/ulysses.py --workload transformer --seq-len 256 \
    [--ring R] [--cp C] [--cp-layout contiguous|zigzag] [--cp-comm ring|allgather] [--out DIR]

Sequence parallelism by all-to-all (DeepSpeed-Ulysses), by hand: every sequence split between the ranks,
and around attention two all-to-alls turn the split of the sequence into a split of the heads and back;
--ring R puts ring attention across R groups inside it (USP's hybrid). Gradients averaged over all ranks.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/ulysses.py` runs it as a world of one. Same options as `python -m parallel run ulysses`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("ulysses"))
