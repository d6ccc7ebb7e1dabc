"""torchrun --nproc_per_node=2 scripts/fsdp.py [--workload mlp] [--reshard 1|0] [--mixed-precision bf16] [--out DIR]

torch's FSDP2 (fully_shard), ZeRO-3: each block of the model and then the root sharded over the ranks on an
explicit DeviceMesh; parameters all-gathered just before each block runs and freed after, gradients
reduce-scattered, the optimizer stepping each rank's shards. --reshard 0 keeps the gathered parameters
from forward to backward. One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on
GPUs (--offload cpu there only). Same options as `python -m parallel run fsdp`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp"))
