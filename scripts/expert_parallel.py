"""torchrun --nproc_per_node=2 scripts/expert_parallel.py --workload moe [--ep 2] [--capacity-factor C] [--out DIR]

Expert parallelism by hand: each rank holds some of every layer's experts, tokens travel to their
experts and back by all-to-all (the backward carries the gradients the same way back), dense gradients
averaged over all ranks, each expert's over the ranks that hold it.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/expert_parallel.py` runs it as a world of one. Same options as
`python -m parallel run expert_parallel`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("expert_parallel"))
