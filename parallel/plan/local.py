"""The planner on this machine's own runs: the memory a strategy needs per device for `compare`'s model,
batch and optimizer (fp32, SGD with momentum), so that `--memory-cap` refuses what the planner says
does not fit, before anything starts.

Model state is formulas.sgd_state, the figure each sharded run measures per rank (test_sharded.py);
activations are activations.formula per block (what LayerMeter measures, test_plan.py) times the blocks
and the sequences a device holds, plus the logits; a model without the project's transformer blocks is
counted by its model state alone. Strategies the planner has no layout for (pipelines, tensor, context and
expert parallelism, Hogwild) are not checked here: docs/planner.md.
"""

from __future__ import annotations

import dataclasses

from torch import nn

from parallel.formulas import element_bytes, model_state
from parallel.plan.layouts import Layout, Training
from parallel.plan.memory import in_flight, layer_activations, params_per_gpu
from parallel.plan.models import ModelSpec
from parallel.usermodel import workload_of

# strategy -> the ZeRO stage its model state is sharded by (None: read the zero option)
DATA_PARALLEL = {"single": 0, "data_parallel": 0, "manual_dp": 0, "ddp": 0, "manual_ddp": 0, "zero": None,
                 "zero_optimizer": 1, "fsdp": 3}


def spec_of(model: nn.Module, seq: int = 0) -> ModelSpec | None:
    """The project's transformer (transformer.Transformer: embed, blocks of Block, head) as a ModelSpec,
    gpt or llama; `seq` the run's sequence length (a rotary model has no position table to read it from)."""
    from parallel.transformer import Block, SwiGLU

    dense = (nn.Sequential, SwiGLU)  # the MLPs the formula counts (an MoE block's is not)
    blocks = [m for m in getattr(model, "blocks", []) if isinstance(m, Block) and isinstance(m.mlp, dense)]
    embed = getattr(model, "embed", None)
    if not blocks or embed is None or len(blocks) != len(model.blocks):
        return None
    vocab, width = embed.tokens.weight.shape
    attn, llama = blocks[0].attn, isinstance(blocks[0].mlp, SwiGLU)
    ffn = blocks[0].mlp.w1.out_features if llama else blocks[0].mlp[0].out_features
    seq = embed.positions.weight.shape[0] if embed.positions is not None else seq
    return ModelSpec(len(blocks), width, width // attn.head_size, vocab, max(1, seq), ffn,
                     attn.k.out_features // attn.head_size, arch="llama" if llama else "gpt")


SHARDED = {"fsdp", "fsdp_tp", "fsdp_pp", "fsdp_cp"}  # FSDP2: parameters, gradients and momentum over dp_shard
LAYERED = {"pipeline": "microbatches", "pipeline_dist": "microbatches", "fsdp_pp": "microbatches",
           "model_parallel": ""}  # stages over the devices; the option naming their micro-batches


def layout(name: str, config) -> tuple[Layout, int, int, int] | None:
    """(the planner's Layout, ZeRO stage, shards, micro-batches) of `name` on `config` as this project runs
    it; None for a strategy without model state of its own to predict (hogwild: a replica per process)."""
    from parallel import strategies
    from parallel.dist import Dist

    if name == "hogwild":
        return None
    s = strategies.get(name)
    world, opts = s.world_size(config), s.options(config)
    get = (lambda k, d=0: getattr(opts, k, d)) if opts is not None else (lambda k, d=0: d)
    if name in LAYERED:
        pp = world if name != "fsdp_pp" else get("pp", 2)
        m = get(LAYERED[name], 1) if LAYERED[name] else 1
        dp = world // pp
        mbs = max(1, config.batch_size // dp // max(1, m))
        return Layout(pp=pp, dp=dp, mbs=mbs, schedule="gpipe" if get("schedule", "1f1b") == "gpipe" else "1f1b",
                      zero_stage=3 * (name in SHARDED)), 3 * (name in SHARDED), dp, m
    d = s.dims(config, Dist(world_size=world)) if s.launch == "torchrun" else None
    tp, cp, dp = (d.tp, d.cp, d.dp) if d else (1, 1, world)
    ep = ep_of(config) if name == "expert_parallel" else 1
    stage = 3 if name in SHARDED else DATA_PARALLEL.get(name) or 0
    if name == "zero":
        stage = int(get("zero_stage", 1))
    shards = (d.dp_shard * (cp if name == "fsdp_cp" else 1)) if name in SHARDED and d else dp * cp
    return Layout(tp=tp, dp=dp, cp=cp, ep=ep, mbs=max(1, config.batch_size // dp), zero_stage=stage), stage, shards, 1


def ep_of(config) -> int:
    from parallel.strategies.expert_parallel import ep_of as of

    return of(config)


def need(name: str, config, model: nn.Module) -> dict | None:
    """Bytes the busiest device needs for `name` on `config`, by kind: parameters, gradients, optimizer
    (SGD's momentum), their sum model_state, activations (the blocks' and the logits'), total; None where
    the planner has no layout for it. The in-process data-parallel strategies (data_parallel, manual_dp)
    gather every replica's output on their first device, so its logits are the whole batch's; fsdp
    offloaded to the host keeps no model state on the device. A model that is not the project's transformer
    is counted by its model state alone, and only where that is the parameters divided by the ranks (the
    data-parallel family)."""
    found = layout(name, config)
    if found is None:
        return None
    lay, stage, shards, micro = found
    spec = spec_of(model, workload_of(config).input_shape[-1])
    if spec is None and name not in DATA_PARALLEL:
        return None
    element = element_bytes(config.precision)
    psi = sum(p.numel() for p in model.parameters())
    if spec is not None and (lay.tp > 1 or lay.pp > 1 or lay.ep > 1):
        dense, experts = params_per_gpu(spec, lay, "first")
        psi = dense + experts
    offloaded = name == "fsdp" and config.options.get("offload") == "cpu"
    state = {k: 0.0 if offloaded else v for k, v in model_state(psi, stage, shards, element, element, element).items()}
    acts = None  # not the project's transformer: its activations are not counted
    if spec is not None:
        accum = int(config.options.get("accum", 1)) if name == "ddp" else 1
        lay = dataclasses.replace(lay, mbs=max(1, lay.mbs // accum))
        precision = "bf16" if config.precision == "bf16" else "fp32"  # autocast's activations are bf16
        layer = layer_activations(spec, lay, Training(1, precision, "flash")) * (1 + (config.precision == "fp64"))
        held = in_flight(lay, micro) if lay.pp > 1 else 1
        gathered = config.batch_size if name in ("data_parallel", "manual_dp") else lay.mbs
        logits = gathered * spec.seq / lay.cp * spec.vocab / lay.tp * 4 * 2  # the logits and their softmax
        acts = lay.layers(spec.layers) * layer * held + logits
    model_bytes = sum(state.values())
    return {**state, "model_state": model_bytes, "activations": acts, "total": model_bytes + (acts or 0.0),
            "layout": lay.describe()}
