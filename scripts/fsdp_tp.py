"""torchrun --nproc_per_node=4 scripts/fsdp_tp.py --workload mlp|transformer [--tp 2]

FSDP2 x tensor parallelism on a 2-D mesh (dp = devices / tp, tp innermost): every tp group splits the layers
as scripts/tensor_parallel.py does, and every block is sharded over the dp ranks with fully_shard; the batch
split by dp coordinate. One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs.
Same options as `python -m parallel run fsdp_tp`. (HSDP: scripts/fsdp.py --replicate R.)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp_tp"))
