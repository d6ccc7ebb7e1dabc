"""torchrun --nproc_per_node=2 scripts/zero.py [--workload mlp] [--zero-stage 1|2] [--out DIR]

ZeRO-1 and ZeRO-2 written by hand: data parallel where each rank owns one slice of the flat parameters
and only that slice's optimizer state (stage 2: and gradient); reduce-scatter the gradients, step the
slice with torch's own update rule, all-gather the parameters. One process per device, gloo on CPU
(cpu:N, N = --nproc_per_node), nccl on GPUs. Same options as `python -m parallel run zero`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("zero"))
