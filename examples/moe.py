"""Your own mixture-of-experts model: a small token model whose feed-forward layers are routed experts.

    ./launch.sh compare --model examples/moe.py:moe --vocab 128 --seq-len 32 --batch-size 64

Build the routed layers from `parallel.models.moe.MoE` (a router, E experts, top-k gates) and expert_parallel
can split them: it finds every MoE in the model (or the model's own `moe_layers()`, which says which and
in what order), keeps each rank's share of every layer's experts and replaces the layer's `dispatch`
with its all-to-all. Anything else between the layers is yours. A model whose experts are some other
module (a Hugging Face Mixtral's, say) is trained by every other strategy and skipped by
expert_parallel with the reason.

Here: token embedding, then 3 residual blocks of LayerNorm + MoE (8 experts of width 64 -> 128 -> 64,
each token to its top 2), a final LayerNorm and a head. No attention: each token predicts the next
from itself, which the synthetic Markov-chain data makes learnable. `moe_aux` turns on the
load-balancing loss (then only `single` and expert_parallel train it: its counts are the batch's).
"""

from torch import nn

from parallel.models.moe import MoE


class Block(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int, aux: float):
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(width), MoE(width, experts, top_k, 2 * width, aux)

    def forward(self, x):
        return x + self.moe(self.norm(x))


class TokenMoE(nn.Module):
    def __init__(self, vocab: int = 128, width: int = 64, depth: int = 3, experts: int = 8, top_k: int = 2,
                 aux: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*[Block(width, experts, top_k, aux) for _ in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def forward(self, tokens):  # (B, T) -> (B, T, vocab)
        return self.head(self.blocks(self.embed(tokens)))

    def moe_layers(self) -> list[MoE]:
        """The routed layers, in order (optional: without it, every MoE the model holds is found)."""
        return [b.moe for b in self.blocks]


def moe(vocab: int = 128):
    return {"model": TokenMoE(vocab)}  # the run's --vocab (the factory's parameter of that name)


def moe_aux(vocab: int = 128):
    return {"model": TokenMoE(vocab, aux=0.01)}
