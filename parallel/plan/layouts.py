"""What a plan is about: a layout of the GPUs (`Layout`) and how the model is trained (`Training`)."""

from __future__ import annotations

import dataclasses
import math

ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallel: carved out of dp x cp, as torchtitan does
    mbs: int = 1  # sequences per micro-batch
    stages_per_rank: int = 1  # interleaving (v)
    zero_stage: int = 0
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    ulysses: int = 1  # of the cp ranks, those whose attention turns by all-to-all (kit/ulysses.py); the other
    #   cp / ulysses pass K, V around a ring: ulysses 1 ring attention, cp all-to-all alone, between them the hybrid

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def tokens(self, seq: int) -> float:
        """Positions a micro-batch puts through one GPU's layers (context parallel: s / cp of each)."""
        return self.mbs * seq / self.cp

    def shards(self) -> tuple[int, int]:
        """(ranks a dense parameter's ZeRO shards and data-parallel reductions span: dp x cp; ranks holding
        the same experts: dp x cp / ep)."""
        return self.dp * self.cp, max(1, self.dp * self.cp // self.ep)

    def layers(self, model_layers: int) -> int:
        """Layers on the busiest rank: stages of ceil(L / (pp v)) layers, v of them (pp need not divide L:
        Llama 3 405B ran 126 layers in 16 stages)."""
        return math.ceil(model_layers / (self.pp * self.stages_per_rank)) * self.stages_per_rank

    def describe(self) -> str:
        """tp4 pp16 dp16 mbs1 v3 z1 sp sel: the dimensions over 1 (cp8 a2a4: 4 of the 8 by all-to-all, a
        ring of 2 across them), micro-batch, interleaving, ZeRO stage, sequence parallel, recompute."""
        parts = [f"{k}{getattr(self, k)}" for k in ("tp", "pp", "dp", "cp") if getattr(self, k) > 1] or ["dp1"]
        parts += [f"a2a{self.ulysses}"] * (self.ulysses > 1) + [f"ep{self.ep}"] * (self.ep > 1)
        parts += [f"mbs{self.mbs}"] + ([f"v{self.stages_per_rank}"] if self.stages_per_rank > 1 else [])
        parts += [f"z{self.zero_stage}"] * (self.zero_stage > 0) + ["sp"] * self.sequence_parallel
        parts += [{"none": "", "selective": "sel", "full": "full"}[self.recompute]]
        parts += [self.schedule] * (self.schedule != "1f1b")
        return " ".join(p for p in parts if p)


@dataclasses.dataclass(frozen=True)
class Training:
    global_batch: int  # sequences per optimizer step
    precision: str = "bf16"
    attention: str = "flash"  # flash: fused kernel, no s^2 tensors, causal half skipped; unfused: Megatron 2021-22
    dropout: bool = False  # Megatron's published runs: dropout on (masks kept, more elementwise traffic)
    grad_bytes: int = 4  # fp32 gradients (Megatron's main_grad; FSDP2 reduces in fp32 by default)
    dp_overlap: bool = True  # data-parallel collectives under backward (DDP, FSDP2); Megatron 2021-22: False
    pp_scatter_gather: bool = True  # Narayanan's: a hand-off sends 1/tp of the activation across nodes
    optimizer_bytes: int = 12  # fp32 master copy, Adam's two moments (a fp32 run has no master: 8)
    optimizer: str = "adam"  # a key of OPTIMIZERS: what its step moves, and whether the weights stay fp32
    elementwise: float = 1.0  # elementwise bytes over the fused count (Megatron's kernels); eager torch: more
    # What differs between software stacks beyond those (stacks.py names each stack's values and their sources):
    partition: str = "even"  # pipeline stages: "even" (ceil(L/pp) layers each, head last) or "cost" (nanotron's)
    grad_copy_bytes: int = 0  # a 16-bit gradient kept beside the fp32 one (nanotron: .grad, DDP's buckets)
    zero_reduce: str = "reduce_scatter"  # ZeRO-1/2's gradient reduction; nanotron (2024): one fp32 all-reduce
    zero_overlap: bool = True  # ZeRO-1/2's reduction under backward (where dp_overlap); nanotron: after it
    loss_bytes: int = 16  # bytes the loss moves per logit element, forward and backward
    host: float = 1.0  # the host's time per kernel over eager torch's (Efficiency.launch_s)
    zero_stages: tuple = (0, 1, 2, 3)  # what the stack can run: the search tries no other
    recomputes: tuple = ("none", "selective", "full")
    interleaved: bool = True  # pipeline stages interleaved on a rank (v > 1)
    fill: bool = False  # the pipeline asserts at least pp - 1 micro-batches a step (nanotron's 1F1B)
    activation_scale: float = 1.0  # what a run holds per micro-batch (activations, logits) over the count of it
    memory_fixed_gib: float = 0.0  # memory no tensor holds: the CUDA context, NCCL's buffers
    memory_usable: float = 0.95  # of the rest, what the caching allocator can hand out (fragmentation)

    def __post_init__(self):
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.optimizer!r}: one of {', '.join(OPTIMIZERS)}")
        if self.partition not in ("even", "cost"):
            raise ValueError(f"partition {self.partition!r}: even or cost")


# What an optimizer step reads and writes per parameter it owns (bytes), and the state it keeps beside the
# weights and gradients (bytes; None: Training.optimizer_bytes). "adam" is the planner's own: mixed precision,
# 16-bit weights with an fp32 master copy and two moments (read the fp32 gradient, master and moments, write
# them and the 16-bit copy: 30). The "sgd" ones are `compare`'s (train.make_optimizer: torch.optim.SGD over fp32
# weights, also under bf16 autocast, which casts them in each forward): with momentum, torch runs
# buf.mul_(momentum), buf.add_(grad), param.add_(buf, alpha=-lr) (foreach on a GPU, a loop on a CPU: the same
# bytes), 8 + 12 + 12 = 32 and one fp32 buffer; without, param.add_(grad) alone, 12 and nothing kept.
# "adamw-fp32" is compare's under --optimizer adamw (torch.optim.AdamW over fp32 weights): at least the gradient,
# weight and two moments read, the weight and moments written (28), and decoupled decay's pass over the weights
# (8): 36, the least it moves (torch's foreach AdamW makes temporaries too); two fp32 moments kept.
OPTIMIZERS = {"adam": (30, None), "sgd-momentum": (32, 4), "sgd": (12, 0), "adamw-fp32": (36, 8)}


def weight_bytes(train: Training) -> int:
    """Bytes of a weight as the GPU keeps it: 4 in fp32, and under the SGD ones (autocast over fp32 weights)."""
    return 4 if train.precision == "fp32" or train.optimizer != "adam" else ELEM[train.precision]


def micro_batches(lay: Layout, train: Training) -> int:
    return max(1, train.global_batch // (lay.dp * lay.mbs))
