"""Software stacks: what a plan assumes of the code that trains, beside the GPU's own efficiencies.

A stack is a profile of `layouts.Training` fields, each with where it came from: read in the stack's source,
measured, or fitted (and then on which rows, by `python -m parallel.plan.evidence.fit`, which writes these numbers
again from those rows). The GPU kinds stay apart (hardware.py): a stack says what its software does on
any of them.
"""

from __future__ import annotations

# torch today (FSDP2, DDP): eager PyTorch under autocast. Flash attention, no dropout, data-parallel
# collectives overlapped with backward [read: torch's DDP and FSDP2]. Its elementwise kernels (an fp32
# residual stream and a cast before each Linear under autocast, LayerNorm and GELU unfused, bias gradients)
# move 3.5 times the bytes of Megatron's fused ones [measured: a profile of a bare loop on GPT-2 small, one
# H100, docs/planner.md "One GPU"]; the rest of that loop's step is its calibration, not the stack's.
TORCH = {"attention": "flash", "dropout": False, "dp_overlap": True, "elementwise": 3.5}

# Megatron-LM as the 2021-22 papers ran it: attention unfused with dropout, data parallel not overlapped
# [read: Korthikanti et al. 2022 section 6.3]; its A100 efficiencies are hardware.py's, fitted on
# Korthikanti Table 5 (fit.py).
MEGATRON_2022 = {"attention": "unfused", "dropout": True, "dp_overlap": False}

# nanotron as the Ultra-Scale Playbook's sweep ran it (2024; bench_cluster's base config and nanotron's code,
# read at huggingface/bench_cluster f55b5e5 and huggingface/nanotron, docs/planner.md "nanotron"):
# - flash attention (flash_attn_varlen_func), Triton RMSNorm, SiLU x up unfused, pure bf16 (no autocast);
# - bf16 parameters and gradients, fp32 gradient accumulation buffers and master weights, AdamW's two fp32
#   moments; ZeRO-1 shards the master and the moments only [read: FP32GradientAccumulator, zero.py];
# - ZeRO-0: DDP's fp32 all-reduce under the last micro-batch's backward; ZeRO-1 (without DDP then): one
#   all-reduce of the fp32 buffer after backward, then an all-gather of the bf16 parameters, not overlapped;
# - pipeline stages split greedily by cost, a layer 4h^2 + 3Fh, the head Vh [read: build_model];
# - the loss: bf16 logits, an fp32 copy, an fp32 softmax kept for backward: 10 bytes held per logit element,
#   about 52 moved forward and backward [read: _ShardedCrossEntropy, counted in docs/planner.md].
# The fitted fields (fit.py, on the Playbook's one-node rows alone: parallel/plan/data) are marked.
NANOTRON = {"attention": "flash", "dropout": False, "dp_overlap": True, "partition": "cost",
            "grad_copy_bytes": 2,  # DDP's bf16 buckets (ZeRO-0)
            "zero_reduce": "all_reduce", "zero_overlap": False, "loss_bytes": 52,
            "zero_stages": (0, 1), "recomputes": ("none", "full"), "interleaved": False,  # what it ran then
            "fill": True,  # its 1F1B engine asserts at least pp - 1 micro-batches [read: engine.py]
            "elementwise": 6.1,  # fitted
            "host": 1.75,  # fitted
            "activation_scale": 1.6,  # fitted
            "memory_usable": 0.91}  # fitted

STACKS = {"torch": TORCH, "megatron-2022": MEGATRON_2022, "nanotron": NANOTRON}
