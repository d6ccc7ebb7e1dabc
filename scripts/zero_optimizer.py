"""torchrun --nproc_per_node=2 scripts/zero_optimizer.py [--workload mlp] [--out DIR]

torch's ZeroRedundancyOptimizer with DistributedDataParallel, the library's ZeRO-1: each rank owns whole
parameters (assigned greedily by size) and their optimizer state; DDP all-reduces the gradients, each rank
steps what it owns and broadcasts it. One process per device, gloo on CPU (cpu:N, N = --nproc_per_node),
nccl on GPUs. Same options as `python -m parallel run zero_optimizer`; read it beside scripts/zero.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("zero_optimizer"))
