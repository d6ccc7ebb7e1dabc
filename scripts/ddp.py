"""torchrun --nproc_per_node=2 scripts/ddp.py [--workload cnn] [--steps 20] [--accum K] [--bucket-mb MB] [--out DIR]

DistributedDataParallel: one process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on
GPUs (the device from LOCAL_RANK). `python scripts/ddp.py` runs it as a world of one. Same options as
`python -m parallel run ddp`; with --out, rank 0 writes the same results.json.
Several nodes: torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 scripts/ddp.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("ddp"))
