"""torchrun --nproc_per_node=2 scripts/fsdp_cp.py [--workload cnn] [--bucket-mb MB] [--naive 1] [--out DIR]

DistributedDataParallel written by hand: gradient hooks that all-reduce as backward produces the
gradients, in buckets overlapping backward (--bucket-mb, 25 by default), or one blocking all-reduce per
parameter (--naive 1). One process per device, gloo on CPU (cpu:N, N =
--nproc_per_node), nccl on GPUs; `python scripts/fsdp_cp.py` runs it as a world of one. Same options
as `python -m parallel run fsdp_cp`; read it beside scripts/ddp.py, torch's own.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("fsdp_cp"))
