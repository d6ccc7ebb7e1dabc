"""pipeline_dist: torch.distributed.pipelining: each stage in its own process, activations sent point to point.

    torchrun --nproc_per_node=2 scripts/pipeline_dist.py --workload cnn --schedule 1f1b --microbatches 4

`pipeline` runs its stages as threads of one process. Here every rank builds only its own stages (the
model's pipeline_layers(), cut by the same partition as `pipeline`'s, decided on rank 0 and sent to the
others), wraps each in torch's PipelineStage, and one of torch's schedules drives them: activations go
forward and their gradients back with isend/irecv (gloo on CPU, nccl on GPUs).

    schedule           stages per rank    idle fraction in theory (p ranks, m micro-batches)
    gpipe, 1f1b        1                  (p-1)/(m+p-1)
    interleaved1f1b    2, in a loop       (p-1)/(2m+p-1): rank r holds stages r and r+p, so each
    loopedbfs          2, in a loop         fill and drain costs half a stage (Narayanan et al. 2021)
    interleavedzb      2, in a loop       ZB-H1's (p-1)(F+I-W) of bubble: each backward is split into I
    zbv                2, in a V          (input) and W (weight) and the W's fill the gaps (Qi et al. 2024);
                                          ~0 when F = I = W. The V puts stages r and 2p-1-r on rank r: rank
                                          0 reads the inputs and computes the loss.
    dualpipev          2, in a V          DeepSeek-V3's (2024), at least 2p micro-batches; its overlapped
                                          F&B runs as F then B here (torch has no overlap of its own)

Only the rank with the first stage uses the inputs and only the one with the last stage the targets
and the loss (ParallelDims.loss_pp says which). torch's stages receive into buffers shaped like the first
micro-batch, so m must divide the batch (checked before anything starts: unequal micro-batches fail with
a shape error inside the schedule); with equal micro-batches the schedule's own scaling (scale_grads: the
summed gradients divided by m) makes the mean of the micro-batch means the batch mean, as one device's.
The final parameters go to rank 0 under the model's own names, for the oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from parallel.kit.collectives import every_rank
from parallel.kit.saved import ActivationMeter
from parallel.kit.schedules import TORCH as SCHEDULES  # name -> its row: torch's class, stages a rank, its rules
from parallel.kit.schedules import broken_rule, least_microbatches, stage_ids, torch_lacks
from parallel.kit.stages import agreed_cut, layers_of
from parallel.kit.tied import TiedAcross
from parallel.loop import master
from parallel.loop.tokens import own_mean
from parallel.measure import pipelines
from parallel.measure.stage_time import Busy, timed_loss, timed_stage
from parallel.strategies.base import CLIPPED, Hooks, Mutant, Trainable, injected, model_state_every_rank
from parallel.strategies.model import pipeline
from parallel.world.devices import SHARED_GLOO_NO_P2P
from parallel.world.dims import ParallelDims
from parallel.world.errors import ConfigError

NAME = "pipeline_dist"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    return build(model, make_optimizer, loss_fn, dist, run)


def train_step(t: Trainable, batch, dist):
    s = t.state
    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # the whole batch: stage 0 and the loss use it
    losses: list[torch.Tensor] = []
    t.optimizer.zero_grad(set_to_none=True)
    s.busy.start_step()
    s.schedule.step(*([x] if s.first else []), **({"target": y, "losses": losses} if s.last else {}),
                    return_outputs=False)
    if s.tied is not None and not injected(t, TIE_UNSUMMED):
        s.tied.sum()
    t.optimizer.step()
    s.busy.end_step()
    if not s.last:
        return torch.zeros((), device=t.device)  # not counted (dims: loss_pp)
    return torch.stack([v.detach() for v in losses]).mean()  # equal micro-batches: the batch mean


@dataclass
class State:
    schedule: object  # torch's schedule over this rank's stages
    p: int  # ranks in this rank's pipeline
    rank: int  # this rank's place in it
    stages: list  # this rank's PipelineStages, in stage order
    names: dict[int, list[str]]  # stage index -> the model's name of each of its layers
    bounds: list[int]  # stage i = layers[bounds[i]:bounds[i+1]], every stage of the run
    first: bool  # this rank holds stage 0 (reads the inputs)
    last: bool  # this rank holds the last stage (computes the loss)
    busy: Busy
    tied: TiedAcross | None  # weights several stages use (GPT-2's head): their gradients summed


def build(model, make_optimizer, loss_fn, dist, run, pp=None, each_stage=None,
          batch: int | None = None) -> Trainable:
    """This process's stages of a pipeline over `pp` (a mesh's slice "pp"; None: every process, the default
    group). `each_stage(module)`: applied to each stage, in place or returning a wrapper (fsdp_pp: FSDP2 over
    its slice "dp_shard"); `batch`: the batch this pipeline trains on per step (default: the global batch)."""
    from torch.distributed import pipelining

    o = run.options
    rank, p = (pp.get_local_rank(), pp.size()) if pp is not None else (dist.rank, dist.world_size)
    group = pp.get_group() if pp is not None else None
    torch_name, v, placement = SCHEDULES[o.schedule].cls, o.v, o.placement
    layers = layers_of(model)
    layer_name = {id(m): n for n, m in model.named_modules()}
    batch = batch or run.batch_size
    bounds = agreed_cut(layers, p * v, o.balance, run, dist, -(-batch // o.microbatches))
    ids = stage_ids(rank, p, v, placement)
    busy = Busy([dist.device])
    stages, modules, names = [], [], {}
    for i in ids:  # this rank's layers only: the rest of the model is dropped with `model`
        part = layers[bounds[i]:bounds[i + 1]]
        names[i] = [layer_name.get(id(m)) or m.owners for m in part]  # parallel.models.hf's layers: their parts' names
        module = nn.Sequential(*part).to(dist.device)
        if each_stage is not None:
            module = each_stage(module) or module  # in place (fully_shard), or a wrapper
        modules.append(module)
        stages.append(timed_stage(module, i, p * v, dist.device, group, busy, ActivationMeter(module)))

    loss_fn = own_mean(loss_fn) if injected(run, MICROBATCH_MEAN) else loss_fn
    schedule = getattr(pipelining.schedules, torch_name)(stages[0] if v == 1 else stages, n_microbatches=o.microbatches,
                                                         loss_fn=timed_loss(loss_fn, busy, p * v - 1, o.microbatches),
                                                         scale_grads=not injected(run, SUMMED))
    rank_of = {i: r for r in range(p) for i in stage_ids(r, p, v, placement)}
    # fsdp_pp (each_stage) takes no tied model (its TIES): a sharded weight's copies are not summed here
    tied = TiedAcross(layers, bounds, rank_of.__getitem__, modules, run.pg_timeout) if each_stage is None else None
    if tied is not None and injected(run, TIE_IN_RANK):  # only the weights several ranks hold get summed
        tied.held = lambda held=tied.held: [i for i in held() if tied.collectives[i] is not None]
    local = nn.ModuleList(modules)
    state = State(schedule, p, rank, stages, names, bounds, 0 in ids, p * v - 1 in ids, busy, tied)
    return Trainable(local, make_optimizer(local.parameters()), loss_fn, dist.device, state=state,
                     grad_copies=tied.copies() if tied is not None else {}, clip_alone=injected(run, CLIP_STAGE))


TIED_GPT = {"workload": "transformer", "arch": "gpt", "tied": True, "vocab": 64, "seq_len": 16}  # the tied-head bugs


@dataclass
class Options(pipeline.Options):
    schedule: str = field(default="1f1b", metadata={"help": "torch's schedule: " + ", ".join(SCHEDULES)})
    stages_per_rank: int = field(default=0, metadata={"help": "stages each rank holds (0: the schedule's own, 1 "
                                                              "or 2); the looped schedules take 2 or more"})

    def schedules(self) -> dict:
        return SCHEDULES

    def __post_init__(self):
        super().__post_init__()
        if why := broken_rule(self.schedule, self.stages_per_rank):  # the schedule's row: the options' rules
            raise ConfigError(why)

    @property
    def v(self) -> int:
        """Stages per rank."""
        return self.stages_per_rank or SCHEDULES[self.schedule].per_rank

    @property
    def placement(self) -> str:
        """Stage i on rank i % p ("loop") or in a V ("v")."""
        return SCHEDULES[self.schedule].placement

    @property
    def loss_pp(self) -> int:
        """The pipeline coordinate of the last stage, whose rank computes the loss (ParallelDims.loss_pp)."""
        return 0 if self.placement == "v" else -1


def check(run) -> None:
    check_pipeline(run, run.world_size, run.batch_size)


def check_pipeline(run, p: int, batch: int) -> None:
    """A pipeline of p ranks training on `batch` samples a step (fsdp_pp: one of several): the rules of its
    schedule's row (kit.schedules.broken_rule), then what this torch lacks to run it."""
    o = run.options
    layers = layers_of(run.meta_model)
    holding = sum(any(True for _ in layer.parameters()) for layer in layers)
    if why := broken_rule(o.schedule, o.stages_per_rank, p, o.microbatches, batch, len(layers), holding,
                          run.config.workload or "model"):
        raise ConfigError(why)
    if why := torch_lacks(SCHEDULES[o.schedule].cls, run.spec.backend):  # what was asked is sound
        raise ConfigError(f"{NAME}: {why}")


# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
SUMMED = Mutant("pipeline_dist:summed-microbatches", "scale_grads=False with the micro-batches' mean losses as they "
                "are: the gradients of m micro-batches summed, m times one device's", {"workload": "mlp"})
TIE_UNSUMMED = Mutant("pipeline_dist:tie-unsummed", "the head tied to the token embedding has a copy in the first "
                      "and the last stage, and their gradients are never summed: each learns from one use",
                      TIED_GPT)
TIE_IN_RANK = Mutant("pipeline_dist:tie-within-rank", "dualpipev's V puts the token embedding and the head tied to "
                     "it on rank 0: their copies are summed across ranks only, so in the V nothing sums them",
                     TIED_GPT | {"options": {"schedule": "dualpipev"}})
MICROBATCH_MEAN = Mutant("pipeline_dist:microbatch-mean", "uneven tokens: each micro-batch's loss the mean over "
                         "its own real tokens, averaged by the schedule (docs/loss.md)",
                         {"workload": "transformer", "tokens": "padded"})
CLIP_STAGE = Mutant("pipeline_dist:clip-stage-norm", "each stage clips by its own stage's gradient norm, never "
                    "reduced over the stages (torchtitan#596)", CLIPPED)
MUTANTS = (SUMMED, TIE_UNSUMMED, TIE_IN_RANK, MICROBATCH_MEAN, CLIP_STAGE)


def dims(run, dist) -> ParallelDims:
    """Every rank a pipeline stage (or two) of the one model: each sees the whole batch; the loss is where
    the last stage is."""
    return ParallelDims(world=dist.world_size, pp=dist.world_size, loss_pp=run.options.loss_pp)


def available(spec) -> str | None:
    if spec.count < 2:
        return f"needs 2 devices or more (one stage each), {spec} has {spec.count}"
    return SHARED_GLOO_NO_P2P if spec.shared else None


def fit_microbatches(run, p: int, batch: int) -> dict:
    """The micro-batches a pipeline of p ranks gets where the user gave none: the fewest of at least the
    Options' default and p (fewer leave a stage idle for the whole step; 1f1b refuses them) that divide the
    `batch` samples it takes a step (torch's stages receive into buffers of one micro-batch's shape) and,
    for the looped schedules, come in whole rounds of p. None fits: the default stays, and check says why."""
    o = run.options
    least = max(Options.microbatches, p, least_microbatches(o.schedule, p))
    for m in range(least, batch + 1):
        if batch % m == 0 and (o.v == 1 or m % p == 0):
            return {"microbatches": m}
    return {}


def defaults(run) -> dict:
    return fit_microbatches(run, run.world_size, run.batch_size)


def state_dict(t: Trainable) -> dict[str, torch.Tensor]:
    """Every rank's stages, under the model's own names, merged (a collective; rank 0 uses it)."""
    mine, masters = {}, master.masters(t.optimizer)  # bf16-master: a DTensor's fp32 master in its place
    for stage in t.state.stages:
        params = dict(stage.submod.named_parameters())
        for key, value in stage.submod.state_dict().items():
            value = masters.get(id(params.get(key)), value)
            index, _, rest = key.removeprefix("module.").partition(".")
            owner = t.state.names[stage.stage_index][int(index)]
            if isinstance(owner, dict):  # parallel.models.hf's layer: "block.<rest>" is <the block's name>.<rest>
                part, _, rest = rest.partition(".")
                owner = owner[part]
            whole = value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2's shards: a collective
            mine[f"{owner}.{rest}"] = whole.detach().cpu().clone()
    return {k: v for part in every_rank(mine) for k, v in part.items()}


def memory_layout(run, layout):
    o = run.options  # the micro-batches a stage holds (the planner's memory)
    return layout.replace(microbatches=o.microbatches, schedule=o.schedule)


LAYERED = True  # cuts the model's pipeline_layers() into stages
CHECKPOINTS = False  # each rank's stages depend on the split measured at start-up; not resumable across runs

MEASURE = pipelines.Torch()

HOOKS = Hooks(available=available, dims=dims, check=check, defaults=defaults, state_dict=state_dict,
              model_state_bytes=model_state_every_rank, memory_layout=memory_layout)
