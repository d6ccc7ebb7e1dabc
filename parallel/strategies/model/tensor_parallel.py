"""tensor_parallel: the same Megatron split with torch's DTensor: parallelize_module on a DeviceMesh.

    torchrun --nproc_per_node=2 scripts/tensor_parallel.py --workload mlp|transformer
             [--sequence-parallel 1] [--loss-parallel 1]      (both: the transformer)

The diff from `manual_tp`: the model's TPPlan (workloads.py) becomes a parallelize_module plan, and
DTensor does what f and g did by hand. A colwise layer (ColwiseParallel) holds its weight as
DTensor(Shard(0)), a rowwise one (RowwiseParallel) as DTensor(Shard(1)), whose output is Partial until it
is redistributed to Replicate (g: an all-reduce). A region (PrepareModuleInput, Replicate in and out,
DTensor passed on) hands its input to q, k and v as one replicated DTensor: their input gradients add up as
Partial and become Replicate once (f: one all-reduce backward), not once for each of q, k and v.

--sequence-parallel 1 (Korthikanti et al. 2022): between the split regions, activations stay split along
the sequence (the norms run on their T/N positions, SequenceParallel), so each g becomes a reduce-scatter
(RowwiseParallel(output_layouts=Shard(1))) and each f an all-gather (PrepareModuleInput from Shard(1)):
the same bytes, and the norms' and residuals' activations are 1/N per rank. The norms' parameter
gradients are then partial on every rank, and DTensor all-reduces them (small: 2 x C per norm).

--loss-parallel 1: the head is split by vocabulary (ColwiseParallel, output Shard(-1)), and the
cross-entropy runs on the split logits under loss_parallel(): no rank ever holds B x T x V logits.

Fewer kv heads than ranks: each copied to the ranks that read it, as in manual_tp (kit/kv_copies.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from torch import nn

from parallel.kit import kv_copies
from parallel.kit.collectives import sum_as_made
from parallel.loop import optim
from parallel.measure import layers
from parallel.models.outputs import call
from parallel.models.workloads import summed_params, tp_plan_of
from parallel.strategies.base import (
    CLIPPED,
    Hooks,
    Mutant,
    Trainable,
    full_state_dict,
    injected,
    model_state_every_rank,
)
from parallel.strategies.model import manual_tp
from parallel.world.devices import SHARED_GLOO_NO_DTENSOR
from parallel.world.dims import ParallelDims
from parallel.world.dist import local
from parallel.world.errors import ConfigError

NAME = "tensor_parallel"
LAUNCH = "torchrun"
SYNCHRONOUS = True


def setup(model, make_optimizer, loss_fn, dist, run) -> Trainable:
    from torch.distributed.tensor import DTensor

    o = run.options
    copies = kv_copies.copied(model, dist.world_size, dist.rank)  # fewer kv heads than ranks: each head m times
    summed = summed_params(model)  # whole weights on this rank's heads (TPPlan, q_norm), found before the split
    mesh = dims(run, dist).mesh(dist.device.type)
    model = apply(model.to(dist.device), mesh, o, run)
    if not injected(run, NORM_UNSUMMED):  # their gradients summed over the ranks
        sum_as_made(summed, mesh.get_group())
    if injected(run, COUNT_REPLICATED) and hasattr(loss_fn, "weigh"):  # the count summed over every rank
        weigh, tp = loss_fn.weigh, dist.world_size
        loss_fn.weigh = lambda density: weigh(density if density is None else density * tp)
    whole = tuple(range(dist.world_size))  # what the plan leaves whole, every tp rank holds alike (--check-replicas)
    if injected(run, NORM_TP_TIMES):  # the bug: each rank's norm summed over the group as if all it held were a slice
        whole = (dist.rank,)
    return Trainable(model, make_optimizer(by_kind(model.parameters())), loss_fn, dist.device,
                     state=State(bool(o.loss_parallel), copies),
                     held_by={k: whole for k, p in model.named_parameters() if not isinstance(p, DTensor)}
                     | kv_copies.held_by(copies))


def train_step(t: Trainable, batch, dist):
    from torch.distributed.tensor.parallel import loss_parallel

    x, y = (b.to(t.device, non_blocking=True) for b in batch)  # the whole batch, on every rank
    with loss_parallel() if t.state.loss_parallel else contextlib.nullcontext():
        t.optimizer.zero_grad(set_to_none=True)
        if injected(t, PADDING_COUNTED):  # the vocabulary-parallel path's targets clamped into the vocabulary
            y = y.clamp(min=0)
        loss = t.loss_fn(call(t.model, x, y), y)
        loss.backward()
        kv_copies.sum_copies(t.model, t.state.copies)  # a kv head's copies: their ranks' shares of its gradient
        t.optimizer.step()
    return local(loss).detach()  # a replicated DTensor under loss parallelism: every rank's is the whole


@dataclass
class State:
    loss_parallel: bool  # the head's logits split by vocabulary into the loss
    copies: kv_copies.Copies | None = None  # kv heads fewer than the ranks: each copied to the ranks reading it


def plan(model: nn.Module, o: Options, run) -> dict:
    """parallelize_module's plan from the model's TPPlan, with sequence and loss parallelism as asked."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    tp = tp_plan_of(model)
    split_between = Shard(1) if o.sequence_parallel else Replicate()  # activations between the split layers
    styles = {name: ColwiseParallel() for name in tp.colwise}
    styles |= {name: RowwiseParallel(output_layouts=split_between) for name in tp.rowwise}
    regions = [*tp.regions]
    if o.sequence_parallel:  # every block's norms on their positions; the MLPs become regions (all-gather in)
        regions += list(dict.fromkeys(name.rpartition(".")[0] for name in tp.colwise  # GELU's; SwiGLU's
                                      if name.endswith(("mlp.0", "mlp.w1", "mlp.w3"))))
        styles |= {name: SequenceParallel() for name, m in model.named_modules()
                   if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) and name not in tp.summed  # (those: on heads)
                   and not (injected(run, NORM_UNSYNCED) and name.endswith("norm2"))}
        styles["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
    region = _region_style()
    styles |= {name: region(input_layouts=(split_between,), desired_input_layouts=(Replicate(),)) for name in regions}
    if o.loss_parallel or o.sequence_parallel:
        styles["head.1"] = ColwiseParallel(input_layouts=split_between,
                                           output_layouts=Shard(-1) if o.loss_parallel else Replicate(),
                                           use_local_output=not o.loss_parallel)
    return styles


def _region_style():
    """torch's PrepareModuleInput for a region's input (f), taken from its first tensor argument whether
    given by position (the built-in models) or by keyword (Hugging Face calls attention with keyword
    arguments only; torch's style must be told which, and fails on the other: "module inputs and
    input_layouts should have same length!")."""
    from torch.distributed.tensor.parallel import PrepareModuleInput

    class RegionInput(PrepareModuleInput):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            given, wanted = self.input_layouts[0], self.desired_input_layouts[0]

            def prepare(_, args, kwargs):
                return manual_tp.with_first_input(
                    args, kwargs, lambda x: self._prepare_input_arg(x, device_mesh, given, wanted))

            module.register_forward_pre_hook(prepare, with_kwargs=True)
            return module

    return RegionInput


def by_kind(params) -> list[dict]:
    """The parameters as optimiser groups, each of one kind: plain tensors (what a plan leaves whole:
    embeddings, norms), or DTensors of one mesh. On CUDA torch's optimisers default to their foreach
    kernels, one call over a group's tensors, and a call that mixes DTensors with plain tensors fails ("got
    mixed torch.Tensor and DTensor", seen on an H200; on CPU the default is the per-tensor loop), as does
    one over DTensors of different meshes (fsdp_tp: a split layer's on dp x tp, the rest on dp alone)."""
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        groups.setdefault(p.device_mesh if isinstance(p, DTensor) else None, []).append(p)
    return [{"params": group} for group in groups.values()]


def apply(model: nn.Module, mesh, o: Options, run) -> nn.Module:
    """The Megatron split of `model` over `mesh` (its tensor-parallel ranks; fsdp_tp: its slice "tp")."""
    from torch.distributed.tensor.parallel import parallelize_module

    if o.loss_parallel and injected(run, VOCAB_REMAINDER):
        _rows_per_rank_floored(model.get_submodule("head.1"), mesh.size())
    with optim.kept(model):  # DTensor's parameters are new: each given the kind its name had (loop/optim.py)
        return parallelize_module(model, mesh, plan(model, o, run))


def _rows_per_rank_floored(head: nn.Linear, tp: int) -> None:
    """The tensor_parallel:vocab-remainder-dropped bug: the vocabulary cut into tp shares of V // tp rows,
    the remainder's rows dropped before the head is split (what ColwiseParallel's uneven shards avoid)."""
    keep = head.out_features // tp * tp
    head.weight = optim.like(nn.Parameter(head.weight.detach()[:keep].clone()), head.weight)
    if head.bias is not None:
        head.bias = optim.like(nn.Parameter(head.bias.detach()[:keep].clone()), head.bias)
    head.out_features = keep


@dataclass
class Options:
    sequence_parallel: int = field(default=0, metadata={"help": "1: activations between the split layers stay "
                                                                "split along the sequence (the transformer)"})
    loss_parallel: int = field(default=0, metadata={"help": "1: logits split by vocabulary into the loss "
                                                            "(the transformer)"})

    def __post_init__(self):
        for name in ("sequence_parallel", "loss_parallel"):
            if getattr(self, name) not in (0, 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be 0 or 1, got {getattr(self, name)}")


def check(run) -> None:
    o = run.options
    if (o.sequence_parallel or o.loss_parallel) and run.workload.data != "tokens":
        flag = "--sequence-parallel" if o.sequence_parallel else "--loss-parallel"
        raise ConfigError(f"{flag} needs a sequence model (the transformer): the {run.config.workload} has no "
                          "sequence to split and 10 classes")
    manual_tp.check(run)


# A bug the oracle must catch (`--mutant NAME`; base.Mutant).
NORM_UNSYNCED = Mutant("tensor_parallel:sp-norm-unsynced", "--sequence-parallel with the blocks' second norm left "
                       "out of the plan: it runs on its rank's positions as a plain module, and its weight's "
                       "gradient is never summed over the ranks", {"workload": "transformer",
                                                                    "options": {"sequence_parallel": 1}})
VOCAB_REMAINDER = Mutant("tensor_parallel:vocab-remainder-dropped", "--loss-parallel on a vocabulary tp does not "
                         "divide: the head's split gives each rank V // tp rows, and the last V mod tp tokens' rows "
                         "are never made (their logits missing from the loss; Megatron-LM#1754)",
                         {"workload": "transformer", "vocab": 63, "batch_size": 16, "options": {"loss_parallel": 1}})
PADDING_COUNTED = Mutant("tensor_parallel:padding-counted", "uneven tokens under --loss-parallel: the targets clamped "
                         "into the vocabulary's range, so padding's ignore_index becomes token 0 and counts in the "
                         "loss (docs/loss.md)", {"workload": "transformer", "tokens": "padded",
                                                 "options": {"loss_parallel": 1}})
NORM_UNSUMMED = Mutant("tensor_parallel:qk-norm-unsummed", "Qwen3's q_norm and k_norm (transformers' plan: "
                       "replicated_with_grad_allreduce) left replicated with no sum: each applies to its rank's "
                       "heads, so each rank steps on its heads' part of the gradient (as before issue 60)",
                       {"model": "examples/hf_families.py:qwen3", "vocab": 256, "seq_len": 32, "batch_size": 16})
COUNT_REPLICATED = Mutant("tensor_parallel:count-replicated", "a token file read a rank's rows at a time: the step's "
                          "count of real targets summed over every rank, so the rows each tp rank holds alike are "
                          "counted tp times (the loss 1/tp of its size; loop/tokens.py)",
                          {"model": "examples/hf_llama.py:llama", "data": "examples/data/padded_tokens.npy",
                           "vocab": 256, "seq_len": 32, "batch_size": 16})
NORM_TP_TIMES = Mutant("tensor_parallel:norm-replicated-tp-times", "the clip's gradient norm summed over the tp "
                       "ranks for every parameter: the norms, biases and embeddings the plan leaves whole counted "
                       "tp times", CLIPPED)
MUTANTS = (NORM_UNSYNCED, VOCAB_REMAINDER, PADDING_COUNTED, NORM_UNSUMMED, COUNT_REPLICATED, NORM_TP_TIMES)


def dims(run, dist) -> ParallelDims:
    return manual_tp.dims(run, dist)


def available(spec) -> str | None:
    return SHARED_GLOO_NO_DTENSOR if spec.shared else None


def state_dict(t: Trainable) -> dict:
    """Every DTensor gathered whole (a collective), each copied kv head once."""
    return kv_copies.one_copy(full_state_dict(t), t.state.copies)


TENSOR_PARALLEL = True
LAYER_ACTIVATIONS = True  # a transformer layer's activation bytes beside the formula (activations.py)

# The collectives per block, one forward's saved activations, Megatron's bytes and step (parallel/measure/layers.py)
MEASURE = layers.Megatron(activations=True)

HOOKS = Hooks(available=available, dims=dims, check=check, state_dict=state_dict,
              model_state_bytes=model_state_every_rank)
