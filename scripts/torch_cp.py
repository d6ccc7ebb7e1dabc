"""torchrun --nproc_per_node=2 scripts/torch_cp.py --workload transformer --seq-len 256 --devices cuda:0,1

torch's own context_parallel() around the step: CUDA only (on CPU it is refused with the reason).
One process per device, gloo on CPU (cpu:N, N = --nproc_per_node), nccl on GPUs;
`python scripts/torch_cp.py` runs it as a world of one. Same options as `python -m parallel run torch_cp`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("torch_cp"))
