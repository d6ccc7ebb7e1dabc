"""fsdp_tp: FSDP2 over data parallel x tensor parallel on a 2-D mesh (torchtitan's layout for large models).

    torchrun --nproc_per_node=4 scripts/fsdp_tp.py --workload mlp|transformer --tp 2     (dp 2 x tp 2)

The diff from `tensor_parallel` and `fsdp`: the N ranks form a dp x tp mesh, tp innermost (layout.py: the
ranks of a tensor-parallel group are neighbours, on GPUs the same node's fast links). Each tp group
splits the layers as `tensor_parallel` does (parallelize_module on mesh["tp"]); then every block and the
root are sharded over mesh["dp_shard"] with fully_shard, so each rank holds 1/dp of its tp part (a 2-D
DTensor: Shard on the dp axis, the tp placement on the other). The batch is split by dp coordinate: the tp
ranks of a group see the same share; one of them reports the loss.

    forward, each block   all-gather its shards over dp; the tp all-reduces inside it, as Megatron's
    backward, each block  the same, then its gradients reduce-scattered over dp

HSDP, the other 2-D data-parallel layout, is `fsdp --replicate R`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from parallel.errors import ConfigError
from parallel.layout import ParallelDims
from parallel.outputs import call
from parallel.strategies import fsdp, manual_tp, tensor_parallel
from parallel.strategies.base import (
    Hooks,
    Mutant,
    Trainable,
    full_state_dict,
    injected,
    model_state_every_rank,
    options_of,
)
from parallel.usermodel import shape_model

NAME = "fsdp_tp"
LAUNCH = "torchrun"
SYNCHRONOUS = True
TENSOR_PARALLEL = True

# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
TP_RANKS_SPLIT_BATCH = Mutant("fsdp_tp:tp-ranks-split-batch", "the batch split by global rank, as in plain data "
                              "parallel: the ranks of a tensor-parallel group compute on different samples",
                              {"workload": "mlp", "devices": "cpu:4", "options": {"tp": 2}})
MUTANTS = (TP_RANKS_SPLIT_BATCH,)


@dataclass
class Options:
    tp: int = field(default=2, metadata={"help": "tensor-parallel ranks per group; the rest is data parallel "
                                                 "(dp = devices / tp)"})

    def __post_init__(self):
        if self.tp < 2:
            raise ConfigError(f"--tp must be at least 2 (tp 1 is `fsdp`), got {self.tp}")


def _layout(config, dist) -> ParallelDims:
    tp = options_of(Options, config).tp
    return ParallelDims(world=dist.world_size, dp_shard=dist.world_size // tp, tp=tp)


def dims(config, dist) -> ParallelDims:
    """dp x tp, what the loop asks for each rank's share of the batch; with the fsdp_tp:tp-ranks-split-batch
    bug, every rank its own share, as if all were data parallel."""
    if injected(config, TP_RANKS_SPLIT_BATCH):
        return ParallelDims.data_parallel(dist.world_size)
    return _layout(config, dist)


def available(spec) -> str | None:
    if spec.count < 4:
        return f"needs 4 devices or more (dp 2 x tp 2), {spec} has {spec.count}"
    return tensor_parallel.available(spec)


def check(config) -> None:
    tp, n = options_of(Options, config).tp, config.world_size
    if n % tp or tp == n:
        raise ConfigError(f"--tp {tp} must divide the {n} devices into data-parallel groups of tp ranks, at "
                          f"least 2 of them (dp x tp = {n}; tp alone is `tensor_parallel`)")
    config.check_divisible(n // tp, "data-parallel size")
    model = shape_model(config)
    if why := manual_tp.plan_problems(model, tp):
        raise ConfigError(f"cannot split the {config.workload} over {tp} tensor-parallel ranks: {why}")


def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = _layout(config, dist).mesh(dist.device.type)
    model = model.to(dist.device)
    parallelize_module(model, mesh["tp"], tensor_parallel.plan(model, tensor_parallel.Options(), config))
    for block in fsdp.blocks(model):
        fully_shard(block, mesh=mesh["dp_shard"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["dp_shard"], reshard_after_forward=True)
    params = tensor_parallel.by_kind(model.parameters())
    return Trainable(model, make_optimizer(params), loss_fn, dist.device)


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this dp coordinate's share, every tp rank alike
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)
    loss.backward()
    t.optimizer.step()
    return loss.detach()


def extra_measurements(t: Trainable, data, config, dist, result) -> dict:
    return {"mesh": str(_layout(config, dist)), **result.wire.measurements()}


def predict_step_ms(cal, config, row) -> float | None:
    """`single`'s step on a dp share split tp ways, Megatron's all-reduces of that share's activations over
    tp, and FSDP's two all-gathers and one reduce-scatter of each rank's 1/tp of the parameters over dp,
    none hidden (gloo's reduce-scatter costs an all-reduce; an all-gather half of one)."""
    tp = options_of(Options, config).tp
    dp = config.world_size // tp
    if cal.allreduce_ms(1, tp) is None:
        return None
    share = dataclasses.replace(config, batch_size=config.batch_size // dp, world_size=tp)
    model = shape_model(config)
    megatron = sum(cal.allreduce_ms(p, tp) for p in manual_tp.payloads(model, share))
    allreduce = cal.allreduce_ms(cal.grad_bytes / tp, dp)  # of this rank's 1/tp of the parameters, over dp
    fsdp_ms = (allreduce / 2 if cal.overlaps else allreduce) + 2 * allreduce / 2  # reduce-scatter, 2 all-gathers
    return cal.compute_ms(config.batch_size // dp) / tp + megatron + fsdp_ms


HOOKS = Hooks(dims=dims, available=available, check=check, state_dict=full_state_dict,
              model_state_bytes=model_state_every_rank, extra_measurements=extra_measurements,
              predict_step_ms=predict_step_ms)
