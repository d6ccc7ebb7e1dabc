"""The planner on this machine's own runs: the memory a strategy needs per device for `compare`'s model,
batch and optimizer (fp32; SGD with momentum or AdamW), so that `--memory-cap` refuses what the planner says
does not fit, before anything starts.

Model state is formulas.run_state (K from the run's optimiser: SGD's momentum, AdamW's two moments), the
figure each sharded run measures per rank (test_sharded.py);
activations are activations.formula per block (what LayerMeter measures, test_plan.py) times the blocks
and the sequences a device holds, plus the logits; a model without the project's transformer blocks is
counted by its model state alone. A strategy says how it lays the model out (base.MemoryLayout, its
`memory_layout` hook); only those whose every device holds the whole model or its ZeRO shards are checked
against the cap (`checked`), not the pipelines, tensor, context and expert parallelism, nor Hogwild, which
declares no layout: docs/planner.md.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from parallel.loop.optim import moments
from parallel.measure.formulas import element_bytes, model_state, optimizer_bytes
from parallel.models.usermodel import workload_of
from parallel.plan.layouts import Layout, Training
from parallel.plan.memory import layer_activations, params_per_gpu
from parallel.plan.models import ModelShape
from parallel.plan.stages import in_flight
from parallel.strategies.base import MemoryLayout
from parallel.world.dims import ParallelDims


def shape_of(model: nn.Module, seq: int = 0) -> ModelShape | None:
    """The project's transformer (transformer.Transformer: embed, blocks of Block, head) as a ModelShape,
    gpt or llama; `seq` the run's sequence length (a rotary model has no position table to read it from)."""
    from parallel.models.transformer import Block, SwiGLU

    dense = (nn.Sequential, SwiGLU)  # the MLPs the formula counts (an MoE block's is not)
    blocks = [m for m in getattr(model, "blocks", []) if isinstance(m, Block) and isinstance(m.mlp, dense)]
    embed = getattr(model, "embed", None)
    if not blocks or embed is None or len(blocks) != len(model.blocks):
        return None
    vocab, width = embed.tokens.weight.shape
    attn, llama = blocks[0].attn, isinstance(blocks[0].mlp, SwiGLU)
    ffn = blocks[0].mlp.w1.out_features if llama else blocks[0].mlp[0].out_features
    seq = embed.positions.weight.shape[0] if embed.positions is not None else seq
    return ModelShape(len(blocks), width, width // attn.head_size, vocab, max(1, seq), ffn,
                     attn.k.out_features // attn.head_size, arch="llama" if llama else "gpt")


def declared(name: str, config) -> MemoryLayout | None:
    """How `name` lays out the model on `config`, as it declares it (its memory_layout hook, given the
    default of its processes' dims); None for a strategy the planner has nothing to say of (Hogwild)."""
    from parallel import strategies
    from parallel.world.dist import Dist

    s = strategies.get(name)
    world = s.world_size(config)
    dims = s.dims(config, Dist(world_size=world)) if s.launch == "torchrun" else ParallelDims.data_parallel(world)
    splits = bool(s.TENSOR_PARALLEL or s.LAYERED or s.SEQUENCE or s.EXPERTS)
    return s.memory_layout(config, MemoryLayout.of(dims, splits))


def layout(m: MemoryLayout, batch: int) -> Layout:
    """The planner's Layout of a declared one, for a global batch of `batch` sequences: a micro-batch is
    the dp share cut into the pipeline's micro-batches; the planner's schedules are gpipe and 1f1b."""
    mbs = max(1, batch // m.dp // max(1, m.microbatches))
    return Layout(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, ep=m.ep, mbs=mbs, zero_stage=m.zero_stage,
                  schedule="gpipe" if m.schedule == "gpipe" else "1f1b")


def checked(name: str, config) -> bool:
    """Does --memory-cap check `name` on `config`? Only where every device holds the whole model or its
    ZeRO shards (the data-parallel family, ZeRO, FSDP): docs/planner.md."""
    m = declared(name, config)
    return m is not None and not m.splits


def need(name: str, config, model: nn.Module) -> dict | None:
    """Bytes the busiest device needs for `name` on `config`, by kind: parameters, gradients, optimizer
    (SGD's momentum or AdamW's moments), their sum model_state, activations (the blocks' and the logits'),
    total; None where the planner has no layout for it. A strategy that gathers every replica's output on its
    first device (data_parallel, manual_dp) holds the whole batch's logits there; one offloaded to the host (fsdp
    --offload cpu) keeps no model state on the device. A model that is not the project's transformer is
    counted by its model state alone, and only where that is the parameters divided by the ranks (only data
    parallel)."""
    m = declared(name, config)
    if m is None:
        return None
    lay, spec = layout(m, config.batch_size), shape_of(model, workload_of(config).input_shape[-1])
    if spec is None and m.splits:
        return None
    element = element_bytes(config.precision)
    psi = sum(p.numel() for p in model.parameters())
    if spec is not None and (lay.tp > 1 or lay.pp > 1 or lay.ep > 1):
        dense, experts = params_per_gpu(spec, lay, "first")
        psi = dense + experts
    shards = m.shards or m.dp * m.cp
    kept = optimizer_bytes(config.precision, moments(config))  # a parameter's optimiser state, in bytes
    state = {k: 0.0 if m.offloaded else v
             for k, v in model_state(psi, m.zero_stage, shards, element, element, kept).items()}
    acts = None  # not the project's transformer: its activations are not counted
    if spec is not None:
        lay = dataclasses.replace(lay, mbs=max(1, lay.mbs // m.accum))
        precision = "bf16" if config.precision in ("bf16", "bf16-master") else "fp32"  # autocast's are bf16
        layer = layer_activations(spec, lay, Training(1, precision, "flash")) * (1 + (config.precision == "fp64"))
        held = in_flight(lay, m.microbatches) if lay.pp > 1 else 1
        gathered = config.batch_size if m.gathers_whole_batch else lay.mbs
        logits = gathered * spec.seq / lay.cp * spec.vocab / lay.tp * 4 * 2  # the logits and their softmax
        acts = lay.layers(spec.layers) * layer * held + logits
    model_bytes = sum(state.values())
    return {**state, "model_state": model_bytes, "activations": acts, "total": model_bytes + (acts or 0.0),
            "layout": lay.describe()}
