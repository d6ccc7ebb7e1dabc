"""fsdp_tp: FSDP2 over data parallel x tensor parallel on a 2-D mesh (torchtitan's layout for large models).

    torchrun --nproc_per_node=4 scripts/fsdp_tp.py --workload mlp|transformer --tp 2     (dp 2 x tp 2)

A composition of `tensor_parallel` and `fsdp`, applied one after the other to the model on one mesh, as
torchtitan's parallelize does: the N ranks form a dp x tp mesh, tp innermost (world/dims.py: the ranks of a
tensor-parallel group are neighbours, on GPUs the same node's fast links). First tensor_parallel.apply on
mesh["tp"] splits the layers within each group; then fsdp.apply on mesh["dp_shard"] shards every block and
the root, so each rank holds 1/dp of its tp part (a 2-D DTensor: Shard on the dp axis, the tp placement on
the other). The batch is split by dp coordinate: the tp ranks of a group see the same share; one of them
reports the loss.

    forward, each block   all-gather its shards over dp; the tp all-reduces inside it, as Megatron's
    backward, each block  the same, then its gradients reduce-scattered over dp

HSDP, the other 2-D data-parallel layout, is `fsdp --replicate R`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from parallel.measure import layers
from parallel.strategies.base import (
    Hooks,
    Mutant,
    Trainable,
    check_beside_dp,
    full_state_dict,
    injected,
    model_state_every_rank,
)
from parallel.strategies.data import fsdp
from parallel.strategies.model import manual_tp, tensor_parallel
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "fsdp_tp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    mesh = mesh_dims(run).mesh(dist.device.type)  # ("dp_shard", "tp"), made once; each dimension its slice
    model = tensor_parallel.apply(model.to(dist.device), mesh["tp"], tensor_parallel.Options(), run)
    fsdp.apply(model, mesh["dp_shard"])  # then every block and the root sharded over dp
    # What the plan leaves whole is a DTensor of the dp slice alone, its shard held alike by the tp group's
    # ranks (its mesh does not say so): --check-replicas compares them, the gradient norm counts them once
    group = tuple(mesh["tp"].mesh.tolist())
    return Trainable(model, make_optimizer(tensor_parallel.by_kind(model.parameters())), loss_fn, dist.device,
                     held_by={k: group for k, p in model.named_parameters() if p.device_mesh.ndim == 1})


train_step = fsdp.train_step  # this dp coordinate's share, every tp rank of a group alike (dims)


def mesh_dims(run) -> ParallelDims:
    """dp x tp: the ranks of a tensor-parallel group neighbours, FSDP over the dp ranks."""
    tp = run.options.tp
    return ParallelDims(world=run.world_size, dp_shard=run.world_size // tp, tp=tp)


@dataclass
class Options:
    tp: int = field(default=2, metadata={"help": "tensor-parallel ranks per group; the rest is data parallel "
                                                 "(dp = devices / tp)"})

    def __post_init__(self):
        if self.tp < 2:
            raise ConfigError(f"--tp must be at least 2 (tp 1 is `fsdp`), got {self.tp}")


def check(run) -> None:
    tp = run.options.tp
    check_beside_dp(run, "tp", tp, "tensor_parallel")
    model = run.meta_model
    if why := manual_tp.plan_problems(model, tp, copies=False):
        raise ConfigError(f"cannot split the {run.config.workload} over {tp} tensor-parallel ranks: {why}")



# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
TP_RANKS_SPLIT_BATCH = Mutant("fsdp_tp:tp-ranks-split-batch", "the batch split by global rank, as in plain data "
                              "parallel: the ranks of a tensor-parallel group compute on different samples",
                              {"workload": "mlp", "devices": "cpu:4", "options": {"tp": 2}})
MUTANTS = (TP_RANKS_SPLIT_BATCH,)


def dims(run, dist) -> ParallelDims:
    """dp x tp, what the loop asks for each rank's share of the batch; with the fsdp_tp:tp-ranks-split-batch
    bug, every rank its own share, as if all were data parallel."""
    if injected(run, TP_RANKS_SPLIT_BATCH):
        return ParallelDims.data_parallel(dist.world_size)
    return mesh_dims(run)


def available(spec) -> str | None:
    if spec.count < 4:
        return f"needs 4 devices or more (dp 2 x tp 2), {spec} has {spec.count}"
    return tensor_parallel.available(spec)


def memory_layout(run, layout):
    return layout.replace(zero_stage=3)  # FSDP2 over the dp ranks (the planner's memory)


TENSOR_PARALLEL = True

# The collectives per block and the mesh; the step: Megatron's over tp, FSDP's over dp (parallel/measure/layers.py)
MEASURE = layers.Megatron(dims=mesh_dims)

HOOKS = Hooks(dims=dims, available=available, check=check, state_dict=full_state_dict,
              model_state_bytes=model_state_every_rank, memory_layout=memory_layout)
