"""torchrun --nproc_per_node=2 scripts/pipeline_dist.py --workload cnn --schedule 1f1b --microbatches 4

torch.distributed.pipelining: each pipeline stage in its own process, activations and their gradients sent
point to point, driven by one of torch's schedules (gpipe, 1f1b, interleaved1f1b, loopedbfs, interleavedzb,
zbv; the last four run two stages on each rank). The same cut of the model as `pipeline`, which runs its
stages as threads of one process. One process per device, gloo on CPU (cpu:N, N = --nproc_per_node),
nccl on GPUs. Same options as `python -m parallel run pipeline_dist`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain clone, too

from parallel.cli import script_main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(script_main("pipeline_dist"))
