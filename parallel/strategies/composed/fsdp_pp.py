"""fsdp_pp: pipeline stages over pp ranks, each stage sharded by FSDP2 over dp ranks: a 2-D mesh pp x dp.

    torchrun --nproc_per_node=4 scripts/fsdp_pp.py --workload transformer --pp 2 --schedule 1f1b

On cpu:4 with --pp 2: ranks 0 and 1 hold stage 0, sharded between them, ranks 2 and 3 stage 1; the pipeline
of ranks {0, 2} trains on the first half of the batch, that of {1, 3} on the second (ParallelDims: pp
outermost, as torchtitan orders its mesh). A composition of `pipeline_dist` and `fsdp` on one pp x dp mesh,
as torchtitan's pipelining does: pipeline_dist.build cuts this rank's stages over mesh["pp"] and hands each
to fsdp.apply on mesh["dp_shard"]. Within a pipeline, activations go point to point (the same stages and
schedules); within a stage, FSDP2 gathers the parameters for each micro-batch's forward and backward and
reduce-scatters the gradients once their last micro-batch is done (torch's schedules drive FSDP2:
PipelineStage knows an FSDPModule).

Refused, from what each did here on torch 2.13 (Options' messages): DDP around the stages (its reducer fails
an internal assert under gpipe and interleaved1f1b, "rebuilt parameter indices size is not same as original
model parameters size"; with static_graph=True it trains off one device, 60.9x the oracle's tolerance on the
MLP: the mutant fsdp_pp:ddp-static-graph; under 1f1b plain DDP happened to match; FSDP2 is what torchtitan
composes with pipelining), and the zero-bubble schedules, whose last stage's sharded parameters never moved
(a 50x mismatch, the stages sharded whole or block by block); gpipe, 1f1b, interleaved1f1b and loopedbfs
match one device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from parallel.measure import pipelines
from parallel.strategies.base import (
    Hooks,
    Mutant,
    Trainable,
    check_beside_dp,
    injected,
    model_state_every_rank,
)
from parallel.strategies.data import fsdp
from parallel.strategies.model import pipeline_dist
from parallel.world.devices import SHARED_GLOO_NO_P2P
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "fsdp_pp"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    dims = _dims(run, dist)
    mesh = dims.mesh(dist.device.type)  # ("pp", "dp_shard"), made once; each dimension its slice

    def shard(stage):  # FSDP2 over the stage's dp ranks; the bug: DDP around it
        if injected(run, DDP_STATIC):
            from torch.nn.parallel import DistributedDataParallel

            return DistributedDataParallel(stage, process_group=mesh["dp_shard"].get_group(), static_graph=True)
        fsdp.apply(stage, mesh["dp_shard"])

    return pipeline_dist.build(model, make_optimizer, loss_fn, dist, run, mesh["pp"], shard,
                               batch=run.batch_size // dims.dp)


train_step = pipeline_dist.train_step


def _dims(run, dist) -> ParallelDims:
    """pp x dp: stages outermost, so a stage's dp ranks are neighbours; the loss where the last stage is."""
    o = run.options
    return ParallelDims(world=dist.world_size, pp=o.pp, dp_shard=dist.world_size // o.pp, loss_pp=o.loss_pp)


@dataclass
class Options(pipeline_dist.Options):
    pp: int = field(default=2, metadata={"help": "pipeline stages (ranks per pipeline); the rest is FSDP2's dp"})
    dp_mode: str = field(default="fsdp", metadata={"help": "how the dp ranks of a stage share it: fsdp (ddp is "
                                                          "refused, with its reason)"})

    def __post_init__(self):
        super().__post_init__()
        if self.pp < 2:
            raise ConfigError(f"--pp must be at least 2, got {self.pp}")
        if self.dp_mode == "ddp":
            raise ConfigError("--dp-mode ddp: DDP around pipeline stages is refused: on torch 2.13 its reducer fails "
                              "an internal assert under gpipe and interleaved1f1b, and with static_graph=True it "
                              "trains silently off one device (measured here; pytorch#144530); use fsdp")
        if self.schedule in ("interleavedzb", "zbv", "dualpipev"):
            raise ConfigError(f"--schedule {self.schedule} with FSDP2 is refused: on torch 2.13 the weight gradients "
                              "of the zero-bubble split backward never reach the last stage's sharded parameters "
                              "(measured here: the oracle's mismatch was 50x its tolerance for zbv, 31x for "
                              "dualpipev, on the last stage's bias)")
        if self.dp_mode != "fsdp":
            raise ConfigError(f"--dp-mode must be fsdp, got {self.dp_mode!r}")


def check(run) -> None:
    pp = run.options.pp
    dp = check_beside_dp(run, "pp", pp, "pipeline_dist")
    pipeline_dist.check_pipeline(run, pp, run.batch_size // dp)
    if injected(run, DDP_STATIC) and torch.__version__ < (2, 13):
        raise ConfigError(f"{DDP_STATIC.name} cannot run on torch {torch.__version__}: there DDP's reducer fails "
                          "its internal assert (expect_autograd_hooks_) even with static_graph=True (measured on "
                          "2.11); on 2.13 the bug runs and trains off one device")



SHARE_BY_STAGE = Mutant("fsdp_pp:share-by-stage", "each rank's share of the batch taken from its place in the "
                        "pipeline (rank // dp) instead of its data-parallel coordinate: a pipeline's first stage "
                        "reads one half's inputs and its last stage the other half's targets",
                        {"workload": "mlp", "devices": "cpu:4", "options": {"pp": 2}})
DDP_STATIC = Mutant("fsdp_pp:ddp-static-graph", "DDP (static_graph=True) instead of FSDP2 around each stage, the "
                    "way round plain DDP's internal assert under a pipeline: it runs, and trains off one device",
                    {"workload": "mlp", "devices": "cpu:4", "options": {"pp": 2}})
MUTANTS = (SHARE_BY_STAGE, DDP_STATIC)


def available(spec) -> str | None:
    if spec.count < 4:
        return f"needs 4 devices or more (pp 2 x dp 2), {spec} has {spec.count}"
    return SHARED_GLOO_NO_P2P if spec.shared else None


def defaults(run) -> dict:
    """Micro-batches fitted to each pipeline's share of the batch (pipeline_dist.fit_microbatches)."""
    pp, n = run.options.pp, run.world_size
    return pipeline_dist.fit_microbatches(run, pp, run.batch_size // max(1, n // pp)) if n % pp == 0 else {}


def dims(run, dist) -> ParallelDims:
    """What the loop asks for each rank's share of the batch and whose loss counts; with the
    fsdp_pp:share-by-stage bug, ranks numbered as if the stage were the inner axis (dp_rank = rank // dp)."""
    if injected(run, SHARE_BY_STAGE):
        pp = run.options.pp
        return ParallelDims(world=dist.world_size, dp_shard=pp, tp=dist.world_size // pp)
    return _dims(run, dist)


def memory_layout(run, layout):
    """For the planner's memory: its stages' micro-batches and schedule, FSDP2 over each stage's dp ranks."""
    o = run.options
    return layout.replace(microbatches=o.microbatches, schedule=o.schedule, zero_stage=3)


LAYERED = True  # cuts the model's pipeline_layers() into stages
TIES = False  # a weight tied across stages would be sharded twice; its copies' gradients are not summed
CHECKPOINTS = False  # as pipeline_dist: the stages depend on the split measured at start-up

MEASURE = pipelines.Torch(dims=_dims)  # the mesh in its result

HOOKS = Hooks(available=available, dims=dims, check=check, defaults=defaults, state_dict=pipeline_dist.state_dict,
              model_state_bytes=model_state_every_rank, memory_layout=memory_layout)
