"""torchrun --nproc_per_node=2 scripts/manual_tp.py --workload mlp|transformer

Megatron tensor parallelism written by hand: column-parallel and row-parallel Linear layers and the two
conjugate functions f (identity forward, all-reduce backward) and g (all-reduce forward, identity backward);
q, k and v split by heads. Every rank trains on the whole batch and holds its part of each split layer.
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs. Same options as
`python -m parallel run manual_tp`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("manual_tp"))
