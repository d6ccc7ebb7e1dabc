"""fsdp: torch's FSDP2 (`fully_shard`), ZeRO-3: parameters, gradients and optimizer state all sharded.

    torchrun --nproc_per_node=2 scripts/fsdp.py [--reshard 1|0] [--mixed-precision bf16] [--offload cpu]

The diff from `ddp`: instead of wrapping the model once, each block of it becomes an FSDP group, then the
root (what is left, the transformer's embeddings). The blocks are the parameter-holding elements of the
model's Sequential/ModuleList containers: the MLP's and CNN's layers, the transformer's blocks and head.
The groups live on an explicit 1-D DeviceMesh ("cpu" + gloo, "cuda" + nccl: without one FSDP2 picks the
accelerator, and a gloo run on a GPU host crashes, pytorch#132471). Every parameter becomes a DTensor
split on its first dimension across the N ranks (padded to a multiple of N); a rank keeps its 1/N of
each, of each gradient and of the optimizer state, and torch's own optimizer steps those shards.

    forward    each group in turn: all-gather its parameters, compute, free them again ("reshard")
    backward   each group, last first: all-gather again, compute, reduce-scatter its gradients (mean)
    step       the optimizer on the local shards: nothing to send (under Muon, each matrix's update
               all-gathered in bf16 and orthogonalised whole: 2 (N-1)/N bytes an element; loop/muon.py)

Bytes a rank sends per step, P the parameters' bytes: all-gather (N-1)/N x P in forward and again in
backward, reduce-scatter (N-1)/N x P: 3 Psi (the ZeRO paper's stage 3). --reshard 0
(reshard_after_forward=False) keeps each group's parameters from forward to backward: no second
all-gather, 2 Psi, and whole parameters held through the step (ZeRO-2's memory for them). The peak of
gathered parameters is measured (parallel/measure/sharded.py): one block and the next (prefetched) at a time.

--mixed-precision bf16 gathers and computes with bf16 parameters (MixedPrecisionPolicy), reduces the
gradients in fp32 and steps fp32 shards: the all-gathers send half the bytes, and it is judged by its
own stated rule (`tolerance`). --offload cpu keeps the shards and the optimizer on the host, on GPUs only.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.loop import optim
from parallel.loop.results import Rule
from parallel.measure import sharded
from parallel.models.outputs import call
from parallel.strategies.base import (
    CLIPPED,
    MUON,
    Hooks,
    Mutant,
    Trainable,
    full_state_dict,
    injected,
    model_state_every_rank,
)
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "fsdp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    o = run.options
    if injected(run, UNSYNCED_INIT) and dist.rank:
        torch.manual_seed(run.seed + dist.rank)  # the bug: a seed of its own on every rank
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
    mesh = dims(run, dist).mesh(dist.device.type)
    kw = {}
    if o.mixed_precision:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               output_dtype=torch.float32)
    if o.offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=True)
    model = model.to(dist.device)
    groups = apply(model, mesh, bool(o.reshard), **kw)
    if injected(run, SUM_NOT_MEAN):  # set on every group (the root's setting is the root's alone)
        for group in groups:
            group.set_gradient_divide_factor(1.0)
            group.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM, nccl's way of dividing
    optimizer = make_optimizer(model.parameters())  # Muon gathers each matrix's shards (loop/muon.py)
    optimizer.alone = injected(run, MUON_ALONE)  # the bug: Newton-Schulz of this rank's shard alone
    return Trainable(model, optimizer, loss_fn, dist.device, state=Sharded(groups),
                     clip_alone=injected(run, CLIP_LOCAL))


def train_step(t: Trainable, batch, dist):
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # this rank's share, (B/N, ...)
    t.optimizer.zero_grad(set_to_none=True)
    loss = t.loss_fn(call(t.model, x, y), y)  # each group all-gathered just before it runs, freed after
    loss.backward()  # gathered again (reshard 1), gradients reduce-scattered group by group
    t.optimizer.step()  # the local shards only
    return loss.detach()


@dataclass
class Sharded:
    groups: list[nn.Module]  # every FSDP group, blocks first, the root last


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's blocks, each to be one FSDP group: the parameter-holding elements of its Sequential and
    ModuleList containers, outermost first, not looking inside a block."""
    out = []
    for child in model.children():
        if isinstance(model, (nn.Sequential, nn.ModuleList)) and any(True for _ in child.parameters()):
            out.append(child)
        else:
            out.extend(blocks(child))
    return out


def apply(model: nn.Module, mesh, reshard: bool | None = True, **policies) -> list[nn.Module]:
    """FSDP2 over `mesh` (a DeviceMesh, or a composition's slice of one): every block an FSDP group, then
    the root, with `policies` (mp_policy, offload_policy); the groups, the root last. reshard None:
    torch's default, the blocks resharded after forward and the root kept for backward."""
    from torch.distributed.fsdp import fully_shard

    # torch 2.13 warns whenever a group's output is a view (a Linear on a 3-D input is one): an in-place op
    # on it would skip the pre-backward all-gather. The loss here never modifies the output in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    groups = blocks(model)
    with optim.kept(model):  # FSDP2's parameters are new DTensors: each given the kind its name had
        for block in groups:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard, **policies)
        # the root last: the parameters no block holds, and the hooks that drive the rest (it reshards as well)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard, **policies)
    return [*groups, model]


MIXED_RTOL = 0.2  # the stated rule for --mixed-precision bf16 (see tolerance)


@dataclass
class Options:
    reshard: int = field(default=1, metadata={"help": "1: free gathered parameters after forward (ZeRO-3, 3 Psi); "
                                                      "0: keep them for backward (2 Psi)"})
    mixed_precision: str = field(default="", metadata={"help": "bf16: gather and compute in bf16, reduce "
                                                                "and step in fp32 (MixedPrecisionPolicy)"})
    offload: str = field(default="", metadata={"help": "cpu: parameter shards and optimizer on the host "
                                                        "(CPUOffloadPolicy; GPUs only)"})
    replicate: int = field(default=1, metadata={"help": "R > 1: HSDP, R replicas each sharded over N/R ranks "
                                                        "(a 2-D mesh: gradients reduce-scattered in a replica, "
                                                        "then all-reduced across them)"})

    def __post_init__(self):
        if self.reshard not in (0, 1):
            raise ConfigError(f"--reshard must be 0 or 1, got {self.reshard}")
        if self.mixed_precision not in ("", "bf16"):
            raise ConfigError(f"--mixed-precision must be bf16 (or empty), got {self.mixed_precision!r}")
        if self.offload not in ("", "cpu"):
            raise ConfigError(f"--offload must be cpu (or empty), got {self.offload!r}")
        if self.replicate < 1:
            raise ConfigError(f"--replicate must be at least 1, got {self.replicate}")


def check(run) -> None:
    run.check_divisible(run.world_size, "world size")
    if (r := run.options.replicate) > 1 and (run.world_size % r or r == run.world_size):
        raise ConfigError(f"--replicate {r} must divide the {run.world_size} devices into replicas of at least "
                          "2 shards each (replicas of 1 are plain data parallel: ddp)")
    if run.options.offload and not run.spec.real:
        raise ConfigError("--offload cpu needs GPUs: FSDP2 pins the offloaded shards in page-locked memory, "
                          "which needs an accelerator (and on CPU devices everything is on the host already)")


# Bugs the oracle must catch (`--mutant NAME`; base.Mutant).
UNSYNCED_INIT = Mutant("fsdp:unsynced-init", "ranks build the model from different seeds: fully_shard broadcasts "
                       "nothing, each rank keeps its slice of its own initialisation")
SUM_NOT_MEAN = Mutant("fsdp:sum-not-mean", "gradient divide factor 1 on every group (set_gradient_divide_factor), "
                      "as if the loss were already a mean over the global batch: gradients summed, not averaged",
                      {"options": {"reshard": 0}})
CLIP_LOCAL = Mutant("fsdp:clip-local-norm", "the gradient norm clipped by is this rank's shard's alone "
                    "(clip_grad_norm_ over local shards, never all-reduced): each rank clips by its own", CLIPPED)
MUON_ALONE = Mutant("fsdp:muon-shard-alone", "under Muon each rank orthogonalises its own dim-0 shard of a matrix "
                    "(Newton-Schulz of the local tensor, as torch.optim.Muon on to_local() shards would), never "
                    "the whole matrix", {**MUON, "devices": "cpu:4"})
MUTANTS = (UNSYNCED_INIT, SUM_NOT_MEAN, CLIP_LOCAL, MUON_ALONE)


def dims(run, dist) -> ParallelDims:
    """Data parallel whose ranks shard the model (each still takes its own share of the batch): one axis,
    or with --replicate R, R replicas of N/R shards each (HSDP)."""
    r = run.options.replicate
    return ParallelDims(world=dist.world_size, dp_replicate=r, dp_shard=dist.world_size // r)


def tolerance(run) -> Rule | None:
    """--mixed-precision bf16 computes forward and backward with bf16 parameters, which `single` (fp32)
    never does: judged by its own stated rule, as `--precision bf16` is (a bf16 product carries a relative
    error of about 2^-8 in every step). Measured against fp32 `single` (5 steps on a batch of 48, seeds 0
    and 1, cpu:2 and cpu:3, --reshard 0 and 1, MLP, CNN, transformer): up to 10.4% of a tensor's movement
    (the MLP's layers.4.weight; the transformer at most 5.1%). The rule allows 20%; a missing average is
    of the order of the movement itself (`fsdp:sum-not-mean` under mixed precision is caught, a test)."""
    if not run.options.mixed_precision:
        return None
    return Rule(MIXED_RTOL, 1e-2, 1e-3, f"fsdp's own rule for bf16 mixed precision ({MIXED_RTOL:.0%} of each "
                                        "tensor's movement)")


def memory_layout(run, layout):
    """For the planner's memory: ZeRO-3 over each replica's N/R ranks; offloaded, nothing on the device."""
    o = run.options
    return layout.replace(zero_stage=3, shards=layout.dp // o.replicate, offloaded=o.offload == "cpu")


# Its measurement (parallel/measure/sharded.py): each rank's shards beside ZeRO-3's formula, the peak of gathered
# parameters, each collective timed alone, the textbook's bytes (3 Psi; 2 without resharding) and the step.
MEASURE = sharded.FullyShard(lambda t: t.state.groups, dims)

HOOKS = Hooks(dims=dims, check=check, state_dict=full_state_dict, model_state_bytes=model_state_every_rank,
              tolerance=tolerance, memory_layout=memory_layout)
