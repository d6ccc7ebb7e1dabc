"""torchrun --nproc_per_node=2 scripts/tensor_parallel.py --workload mlp|transformer [--sequence-parallel 1]
                                                                                [--loss-parallel 1]

Megatron tensor parallelism with torch's DTensor: the model's plan (colwise / rowwise Linear layers, regions)
given to parallelize_module on a DeviceMesh; every rank the whole batch and its part of each split layer.
--sequence-parallel 1 keeps the activations between split layers split along the sequence; --loss-parallel 1
splits the logits by vocabulary into the loss. One process per device, gloo on CPU (cpu:N, N =
--nproc_per_node), nccl on GPUs. Same options as `python -m parallel run tensor_parallel`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("tensor_parallel"))
