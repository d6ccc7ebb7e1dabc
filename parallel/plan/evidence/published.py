"""Published large-scale runs, as data, each with the configuration it ran and what it measured.

Copied from ../shared/planner/published.md (its sources: Narayanan et al. 2021, arXiv 2104.04473, Tables 1
and 2; Korthikanti et al. 2022, arXiv 2205.05198, Table 5 and Figure 1, the latter's values as Calculon's
`calculon/llm/validation.py` transcribes them; the 1T row's interleaving of 1 as Calculon's
`validation/seqsel/tab5/megatron-1T_*.json` has it). Both papers ran Megatron-LM on Selene (A100-80GB,
8 per node, 8 x 200 Gb/s InfiniBand per node), fp16, seq 2048, vocabulary 51200, dropout on, attention
unfused (no flash attention then), data-parallel all-reduce not overlapped (Korthikanti section 6.3).
"""

from __future__ import annotations

from parallel.plan.models import ModelShape

# Narayanan Table 1: (params B, heads, h, L, tp, pp, GPUs, global batch, mbs, v, TFLOP/s per GPU with recompute)
NARAYANAN_T1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 16, 1, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 16, 1, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 16, 1, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 8, 1, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 4, 1, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 2, 3, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 2, 2, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 1, 2, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 1, 3, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 1, 1, 163),
]

# Korthikanti Table 5 and Figure 1: (name, heads, h, L, pp, GPUs = global batch, mbs, v,
#   seconds per iteration with full recompute, with SP + selective, Fig. 1 GiB: model state,
#   activations TP only without recompute, activations SP + selective)
KORTHIKANTI = [
    ("22B", 64, 6144, 48, 1, 8, 4, 1, 1.42, 1.10, 45.5625, 59.25, 9.5625),
    ("175B", 96, 12288, 96, 8, 64, 1, 3, 18.13, 13.75, 45.5625, 66.84375, 12.3515625),
    ("530B", 128, 20480, 105, 35, 280, 1, 3, 49.05, 37.83, 31.640625, 114.0234375, 23.076171875),
    ("1T", 160, 25600, 128, 64, 512, 1, 1, 94.42, 71.49, 32.958984375, 131.25, 26.5625),
]
KORTHIKANTI_GLOBAL_BATCH = {"22B": 4}  # the others: one sequence per GPU (global batch = GPUs)

# Narayanan Table 2, at a fixed global batch: (scheme, model, (GPUs...), (global batch...), (mbs...),
# model-parallel (tp, pp), (TFLOP/s per GPU...)). The interleaving of the PTD-P rows is not given: 1 here.
NARAYANAN_T2 = [
    ("ZeRO-3", "175B", (384, 768, 1536), (1536, 1536, 1536), (4, 2, 1), (1, 1), (144, 88, 44)),
    ("ZeRO-3", "530B", (640, 1120, 2240), (2560, 2240, 2240), (4, 2, 1), (1, 1), (138, 98, 48)),
    ("PTD-P", "175B", (384, 768, 1536), (1536, 1536, 1536), (1, 1, 1), (8, 12), (153, 149, 141)),
    ("PTD-P", "530B", (560, 1120, 2240), (2240, 2240, 2240), (1, 1, 1), (8, 35), (171, 167, 159)),
]
T2_MODELS = {"175B": (96, 12288, 96), "530B": (105, 20480, 128)}  # (L, h, heads) of the paper's 174.6B, 529.6B

# One H100 80GB, this project's own measurement (2026-11-25, ../shared/FIELD-NOTES.md): a bare PyTorch loop on
# GPT-2 small's shape (examples/gpt2.GPT2: width 768, 12 blocks, 12 heads, vocabulary 50,304, 1,024 tokens,
# untied head, 163M parameters), bf16 autocast, fused AdamW, eager, 15 timed steps after 4 of warm-up:
# (micro-batch, ms a step). The planner's gpt ties the head (124M): the same matrix work a token.
H100_GPT2_SMALL = [(1, 30.9), (4, 32.8), (16, 59.5)]

# compare's own `single` step on one H100 (2026-11-26, cuda:0x2, torch 2.11; tests/data/h100_gpt2_small_results.json):
# GPT-2 small's shape with its head untied (163.2M parameters), 16 x 1,024 tokens, bf16 autocast over fp32 weights,
# SGD with momentum 0.9. Nothing was fitted to it: (batch, ms a step).
H100_COMPARE_SINGLE = (16, 55.59063399999786)


def gpt(layers: int, hidden: int, heads: int, name: str = "") -> ModelShape:
    return ModelShape(layers, hidden, heads, 51200, 2048, name=name)


def narayanan_flops(model: ModelShape, global_batch: int) -> float:
    """Narayanan's eq. (3), FLOPs per iteration with full recompute: 96 B s L h^2 (1 + s/6h + V/16Lh)."""
    B, s, L, h, V = global_batch, model.seq, model.layers, model.hidden, model.vocab
    return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))


def korthikanti_model_flops(model: ModelShape, global_batch: int) -> float:
    """Korthikanti's MFU numerator, 72 B s L h^2 (1 + s/6h + V/12Lh): model FLOPs without recompute."""
    B, s, L, h, V = global_batch, model.seq, model.layers, model.hidden, model.vocab
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
