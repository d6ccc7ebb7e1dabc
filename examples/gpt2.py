"""A small GPT-2-style language model, with the protocol's extras: its own layers and a tensor-parallel plan.

    ./launch.sh compare --model examples/gpt2.py:gpt2 --vocab 256 --seq-len 64 --batch-size 64
    ./launch.sh compare --model examples/gpt2.py:gpt2 --vocab 50304 --seq-len 256 --batch-size 8   # GPT-2's vocabulary

GPT-2's shape (Radford et al. 2019): token and position embeddings, pre-norm blocks (LayerNorm,
causal self-attention, LayerNorm, a 4x MLP with GELU, each added to the residual), a final LayerNorm
and a linear head over the vocabulary. Here 4 blocks of width 128 and 4 heads: 0.86M parameters.
Three departures, each for a reason a comparison needs:

- No dropout: with it, every strategy would draw different masks (and a rank's share a different
  one from one device's), and no strategy could match `single` exactly.
- The head is not tied to the token embedding (`gpt2_tied` ties it, as the released GPT-2 does: the
  weight then lives in the first and the last pipeline stage at once, and the pipelines keep the two
  copies in step by summing their gradients, as Megatron does; parallel/kit/tied.py).
- q, k and v are three Linear layers, not one fused one, and the attention reads its head count from
  the tensors: so tensor parallelism can give each rank whole heads (a fused [q|k|v] split into
  contiguous halves would give rank 0 all of q and half of k).

forward() adds the two embeddings, so the model is not its children run in order: the factory says
where a pipeline may cut ("layers"), and how tensor parallelism splits each block ("tp_plan").
"""

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.workloads import TPPlan


class Embeddings(nn.Module):
    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)

    def forward(self, idx):  # (B, T) -> (B, T, C)
        return self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))


class SelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.head_size = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_size).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = SelfAttention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, vocab: int = 256, context: int = 64, width: int = 128, depth: int = 4, heads: int = 4):
        super().__init__()
        self.embed = Embeddings(vocab, context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def forward(self, idx):  # (B, T) token ids -> (B, T, vocab) logits
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gpt2(seed: int, vocab: int = 256, seq_len: int = 64) -> dict:
    """The factory: the model, where a pipeline may cut it, and Megatron's split of each block (q, k, v
    and the MLP's first layer by columns, in one region per attention; the projections by rows). The
    run's --vocab and --seq-len arrive as `vocab` and `seq_len` (the positions it learns: seq_len)."""
    model = GPT2(vocab, seq_len)
    plan = TPPlan.joined(TPPlan(colwise=(f"blocks.{i}.attn.q", f"blocks.{i}.attn.k", f"blocks.{i}.attn.v",
                                         f"blocks.{i}.mlp.0"),
                                rowwise=(f"blocks.{i}.attn.proj", f"blocks.{i}.mlp.2"),
                                regions=(f"blocks.{i}.attn",)) for i in range(len(model.blocks)))
    return {"model": model, "layers": [model.embed, *model.blocks, model.head], "tp_plan": plan}


def gpt2_tied(seed: int, vocab: int = 256, seq_len: int = 64) -> dict:
    """gpt2 with the head's weight tied to the token embedding (the head keeps its bias)."""
    out = gpt2(seed, vocab, seq_len)
    model = out["model"]
    model.head[1].weight = model.embed.wte.weight
    return out
