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

from torch import nn

from parallel.formulas import element_bytes, sgd_state
from parallel.plan.layouts import Layout, Training
from parallel.plan.memory import layer_activations
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


def need(name: str, config, model: nn.Module) -> dict | None:
    """Bytes the busiest device needs for `name` on `config`: model state, activations, total; None where
    the planner has no layout for the strategy. The in-process strategies (data_parallel, manual_dp)
    gather every replica's output on their first device, so its logits are the whole batch's; fsdp
    offloaded to the host keeps no model state on the device."""
    if name not in DATA_PARALLEL:
        return None
    from parallel import strategies

    stage = DATA_PARALLEL[name]
    if stage is None:
        stage = int(config.options.get("zero_stage", 1))
    world = strategies.get(name).world_size(config)  # data_parallel on virtual CPU devices: one
    shards = world // int(config.options.get("replicate", 1)) if name == "fsdp" else world
    psi = sum(p.numel() for p in model.parameters())
    offloaded = name == "fsdp" and config.options.get("offload") == "cpu"
    state = 0.0 if offloaded else sgd_state(psi, stage, shards, element_bytes(config.precision))
    acts = 0.0
    spec = spec_of(model, workload_of(config).input_shape[-1])
    if spec is not None:
        per_device = config.batch_size // world // int(config.options.get("accum", 1) if name == "ddp" else 1)
        layer = layer_activations(spec, Layout(mbs=max(1, per_device)), Training(1, "fp32", "flash"))
        gathered = config.batch_size if name in ("data_parallel", "manual_dp") else per_device
        logits = gathered * spec.seq * spec.vocab * 4 * 2  # the logits and their softmax for the loss
        acts = spec.layers * layer + logits
    return {"model_state": state, "activations": acts, "total": state + acts}
