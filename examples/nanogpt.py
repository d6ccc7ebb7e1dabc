"""A GPT written from scratch in the style of the minimal GPTs people train first (nanoGPT's): its forward
takes the targets and returns `(logits, loss)`, and the harness trains it as it is, with no wrapper.

    ./launch.sh compare --model examples/nanogpt.py:nanogpt --vocab 256 --seq-len 64 --batch-size 64
    python -m parallel compare --model examples/nanogpt.py:nanogpt --vocab 256 --seq-len 32 --devices cpu:2 \\
        --steps 2 --strategies all

forward(idx, targets): every position's logits and their mean cross-entropy. forward(idx) alone: the last
position's logits only, (B, 1, V), and no loss: all that `generate` needs to draw the next token. The
harness sees `targets` in forward's signature, calls it with each batch's targets, and trains on the loss
it returns (parallel/models/outputs.py); the pipelines, which run its layers and not its forward, take the same
cross-entropy over the last stage's logits.

GPT-2's shape (Radford et al. 2019): token + position embeddings, pre-norm blocks (causal self-attention,
a 4x GELU MLP, each added to the residual), a final LayerNorm, a head tied to the token embedding; weights
from N(0, 0.02), the residual projections' scaled by 1/sqrt(2 x layers) (GPT-2's paper, section 2.3).
At the defaults, 4 blocks of width 128 with 4 heads: 0.83M parameters at a vocabulary of 256. Two choices
made for the comparison:

- dropout 0 (the field is kept): with it, every strategy would draw other masks and none could match.
- q, k and v are three Linear layers, not one fused `c_attn`, and attention reads its head count from the
  tensors: so tensor parallelism can give each rank whole heads (contiguous halves of a fused [q|k|v]
  would give rank 0 all of q and half of k).

Its children (embed, h.0 ... h.n-1, ln_f, lm_head) run one after another in forward, so the harness finds
the pipelines' cut points itself; the factory adds Megatron's split of each block for tensor parallelism.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.workloads import TPPlan


@dataclass
class GPTConfig:
    block_size: int = 64  # the longest sequence: positions learned
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True  # biases in the Linear layers and LayerNorms


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "the width must split into whole heads"
        self.head_size, self.dropout = cfg.n_embd // cfg.n_head, cfg.dropout
        self.q, self.k, self.v = (nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias) for _ in range(3))
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C) -> (B, T, C)
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_size).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)  # (B, heads, T, head size)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, -1)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, C) -> (B, T, 4C) -> (B, T, C)
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias), nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn, self.mlp = CausalSelfAttention(cfg), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embeddings(nn.Module):
    """The token's embedding plus its position's."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab_size, cfg.n_embd), nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, idx):  # (B, T) -> (B, T, C)
        return self.drop(self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.embed = Embeddings(cfg)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.embed.wte.weight = self.lm_head.weight  # tied: one matrix reads tokens in and scores them out
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # each block adds two of these to the residual stream
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """idx (B, T) token ids -> (logits, loss). With targets (B, T): every position's logits (B, T, V)
        and their mean cross-entropy (targets of -1 are left out). Without: the last position's (B, 1, V),
        and None."""
        x = self.embed(idx)
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        if targets is None:  # inference: only the next token's scores are wanted
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """idx (B, T) extended by max_new_tokens tokens, each drawn from the model's scores for the next one
        (the `top_k` best only, if given), seeing at most block_size tokens back."""
        for _ in range(max_new_tokens):
            logits, _ = self(idx[:, -self.config.block_size:])
            logits = logits[:, -1, :] / temperature  # (B, V)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            idx = torch.cat([idx, torch.multinomial(F.softmax(logits, dim=-1), num_samples=1)], dim=1)
        return idx


def nanogpt(seed: int, vocab: int = 256, seq_len: int = 64, n_layer: int = 4, n_head: int = 4,
            n_embd: int = 128) -> dict:
    """The factory: the model (its positions: the run's --seq-len; its vocabulary: --vocab) and Megatron's
    split of each block (q, k, v and the MLP's first layer by columns, in one region per attention; the two
    projections by rows). The weights come from torch's generator, which the harness seeds."""
    model = GPT(GPTConfig(block_size=seq_len, vocab_size=vocab, n_layer=n_layer, n_head=n_head, n_embd=n_embd))
    plan = TPPlan.joined(TPPlan(colwise=(f"h.{i}.attn.q", f"h.{i}.attn.k", f"h.{i}.attn.v", f"h.{i}.mlp.c_fc"),
                                rowwise=(f"h.{i}.attn.c_proj", f"h.{i}.mlp.c_proj"), regions=(f"h.{i}.attn",))
                         for i in range(n_layer))
    return {"model": model, "tp_plan": plan}
