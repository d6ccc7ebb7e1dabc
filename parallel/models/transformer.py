"""The built-in decoder-only transformer, in the two shapes the planner describes (plan/models.py):

    gpt     LayerNorm, GELU MLP (ffn 4 x width), learned positions, biases; the head optionally tied
    llama   RMSNorm, SwiGLU MLP, rotary positions (RoPE), grouped-query attention (kv heads < heads),
            no biases

    tokens (B, T) -> embed (+ learned positions) -> [block] x depth -> norm -> head -> logits (B, T, vocab)
    block: x + attention(norm1(x)), then x + mlp(norm2(x))          (pre-norm)

Each piece is split the way the strategies expect: q, k and v are separate Linear layers (split by heads
for tensor parallelism), attention's core is one swappable callable (`Attention.attend`, where context
parallelism puts its ring), and a caller may give the tokens' global positions (a rank of context
parallelism holds a slice of the sequence), which reach the position embedding or the rotation.
The default, `Transformer()`, is the project's small GPT: 64 tokens, context 32, width 128, 2 blocks
of 4 heads, 0.42M parameters, drawn from the seed in the same order as it always was.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F
from torch import nn

from parallel.models.data import BOS
from parallel.models.moe import MoE
from parallel.models.tpplan import TPPlan
from parallel.world.errors import ConfigError

ARCHS = ("gpt", "llama")
ROPE_THETA = 500_000.0  # Llama 3's rotary base (its config.json's rope_theta)


class Transformer(nn.Module):
    """vocab, context (the sequence length), width, depth (blocks), heads; arch gpt or llama; kv_heads
    (0: as many as heads; fewer: grouped-query attention), ffn (0: 4 x width for gpt, 8/3 x width rounded
    up to 64 for llama), tied: the head's weight is the token embedding, and it has no bias (GPT-2's).
    Its parameters are the planner's count for the same shape (ModelShape.params; untied: plus the head's).
    packed (set on a built model, --tokens packed): each sequence is documents one after another, each
    starting with BOS; positions restart at each and attention stays inside it."""

    packed = False

    def __init__(self, vocab: int = 64, context: int = 32, width: int = 128, depth: int = 2, heads: int = 4,
                 arch: str = "gpt", kv_heads: int = 0, ffn: int = 0, tied: bool = False):
        super().__init__()
        self.embed = Embed(vocab, context if arch == "gpt" else 0, width)
        self.blocks = nn.Sequential(*[Block(width, heads, kv_heads=kv_heads, arch=arch, ffn=ffn)
                                      for _ in range(depth)])
        self.head = nn.Sequential(norm(arch, width), nn.Linear(width, vocab, bias=arch == "gpt" and not tied))
        if tied:
            self.head[1].weight = self.embed.tokens.weight

    def forward(self, tokens, positions=None):  # (B, T) -> (B, T, vocab)
        """positions: the tokens' places in the whole sequence (T,), where they are not 0..T-1 (a rank of
        context parallelism holding a slice of it)."""
        documents = None
        if self.packed:
            positions, documents = packed_documents(tokens)
        x = self.embed(tokens, positions)
        for block in self.blocks:
            x = block(x, positions, documents)
        return self.head(x)

    def pipeline_layers(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def attentions(self) -> list[Attention]:
        """The attention of every block: what context parallelism splits by the sequence."""
        return [b.attn for b in self.blocks]

    def tp_plan(self) -> TPPlan:
        """Every block's plan (Block.tp_plan); the embeddings and the head replicated."""
        return TPPlan.joined(b.tp_plan(f"blocks.{i}.") for i, b in enumerate(self.blocks))


class MoETransformer(Transformer):
    """The transformer with every block's MLP replaced by routed experts (parallel/models/moe.py): 4 experts
    (width 128 -> 256 -> 128) per block, each token to its top 2. 64 tokens, context 32, 2 blocks: 0.68M params,
    of which the experts 0.53M.

    aux_loss: the load-balancing loss's weight (MoE.aux_weight); 0, the default, leaves it out.
    """

    def __init__(self, vocab: int = 64, context: int = 32, width: int = 128, depth: int = 2, heads: int = 4,
                 experts: int = 4, top_k: int = 2, aux_loss: float = 0.0):
        nn.Module.__init__(self)
        self.embed = Embed(vocab, context, width)
        self.blocks = nn.Sequential(*[Block(width, heads, MoE(width, experts, top_k, 2 * width, aux_loss))
                                      for _ in range(depth)])
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, vocab))

    def moe_layers(self) -> list[MoE]:
        """Every routed layer: what expert parallelism splits by experts."""
        return [b.mlp for b in self.blocks]

    def tp_plan(self) -> TPPlan:
        """Attention split by heads as in Transformer; the router and the experts replicated."""
        return TPPlan.joined(TPPlan(colwise=tuple(f"blocks.{i}.attn.{n}" for n in "qkv"),
                                    rowwise=(f"blocks.{i}.attn.proj",), regions=(f"blocks.{i}.attn",))
                             for i in range(len(self.blocks)))


def norm(arch: str, width: int) -> nn.Module:
    return nn.LayerNorm(width) if arch == "gpt" else nn.RMSNorm(width, eps=1e-5)


class Embed(nn.Module):
    """Token embedding, plus a learned position embedding of `context` rows (none at 0: rotary models)."""

    def __init__(self, vocab: int, context: int, width: int):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width) if context else None

    def forward(self, tokens, positions=None):  # (B, T) -> (B, T, C)
        x = self.tokens(tokens)
        if self.positions is None:
            return x
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        return x + self.positions(positions)


class Block(nn.Module):
    """x + attention(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(self, width: int, heads: int, mlp: nn.Module | None = None, kv_heads: int = 0,
                 arch: str = "gpt", ffn: int = 0):
        super().__init__()
        self.norm1, self.norm2 = norm(arch, width), norm(arch, width)
        self.attn = Attention(width, heads, kv_heads, rotary=arch == "llama")
        if mlp is None and arch == "gpt":
            mlp = nn.Sequential(nn.Linear(width, ffn or 4 * width), nn.GELU(), nn.Linear(ffn or 4 * width, width))
        self.mlp = SwiGLU(width, ffn or -(-8 * width // 3 // 64) * 64) if mlp is None else mlp

    def forward(self, x, positions=None, documents=None):  # (B, T, C)
        x = x + self.attn(self.norm1(x), positions, documents)
        return x + self.mlp(self.norm2(x))

    def tp_plan(self, prefix: str = "") -> TPPlan:
        """q, k, v split by heads (columns) in one region (their shared input copied once), proj by its
        inputs (rows); the MLP's first layers (GELU's mlp.0; SwiGLU's gate and up) by columns, its last by
        rows. Norms replicated."""
        first, last = (("mlp.w1", "mlp.w3"), "mlp.w2") if isinstance(self.mlp, SwiGLU) else (("mlp.0",), "mlp.2")
        return TPPlan(colwise=tuple(prefix + n for n in ("attn.q", "attn.k", "attn.v", *first)),
                      rowwise=(prefix + "attn.proj", prefix + last), regions=(prefix + "attn",))


class SwiGLU(nn.Module):
    """Llama's MLP: w2(silu(w1 x) * w3 x), no biases."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.w2 = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Attention(nn.Module):
    """Causal self-attention (each token sees its past), with separate q, k and v projections, so that
    each can be split by heads for tensor parallelism; a fused [q | k | v] projection split contiguously
    would give rank 0 all of q and half of k (pytorch#140069). Head counts are read from the tensors
    (their width over the head size), so a rank holding some of the heads computes with those; with
    grouped-query attention (kv_heads < heads) each k/v head serves heads / kv_heads query heads, repeated
    to them before `attend`, so that every attention core (the ring of context parallelism too) sees
    equal heads, unless the core says it takes them grouped (Ulysses: it sends the kv heads, not copies).
    rotary: q and k rotated by their positions (RoPE, Su et al. 2021), Llama's."""

    def __init__(self, width: int, heads: int, kv_heads: int = 0, rotary: bool = False):
        super().__init__()
        self.head_size, self.rotary = width // heads, rotary
        self.attend = causal  # (q, k, v) -> y; context parallelism puts its ring attention here
        kv = (kv_heads or heads) * self.head_size
        bias = not rotary
        fused = nn.Linear(width, width + 2 * kv, bias=bias)  # drawn as one, as a fused projection is
        at = fused.weight.device  # the meta device too: the model's shape at any size, no memory
        self.q = nn.utils.skip_init(nn.Linear, width, width, bias=bias, device=at)  # no draws
        self.k, self.v = (nn.utils.skip_init(nn.Linear, width, kv, bias=bias, device=at) for _ in range(2))
        with torch.no_grad():
            for m, rows in ((self.q, slice(0, width)), (self.k, slice(width, width + kv)),
                            (self.v, slice(width + kv, width + 2 * kv))):
                m.weight.copy_(fused.weight[rows])
                if bias:
                    m.bias.copy_(fused.bias[rows])
        self.proj = nn.Linear(width, width, bias=bias)

    def forward(self, x, positions=None, documents=None):  # (B, T, C) -> (B, T, C)
        """documents: packed sequences' mask (B, 1, T, T), True where a query may see a key (packed_documents)."""
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, -1, self.head_size).transpose(1, 2) for m in (self.q, self.k, self.v))
        if self.rotary:
            at = torch.arange(t, device=x.device) if positions is None else \
                positions if positions.dim() == 2 else positions.reshape(-1)
            q, k = rotate(q, at), rotate(k, at)
        if (group := q.shape[1] // k.shape[1]) > 1 and not getattr(self.attend, "grouped", False):
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        # (B, heads here, T, head size); packed: inside each document (context parallelism refuses packing)
        y = self.attend(q, k, v) if documents is None else F.scaled_dot_product_attention(q, k, v, attn_mask=documents)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


def rotate(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, d) rotated by its positions, (T,) or each row's (B, T): pairs (i, i + d/2) turned by position x
    theta^(-2i/d) (the rotate-half layout Hugging Face's Llama uses). Angles in float32 (float64 for a
    float64 x), so that a position of 8K keeps its precision."""
    d = x.shape[-1]
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    inv = ROPE_THETA ** -(torch.arange(0, d, 2, device=x.device, dtype=dtype) / d)
    angle = positions.to(x.device, dtype)[..., None] * inv  # (T, d/2), or (B, T, d/2)
    cos, sin = (torch.cat((f, f), dim=-1) for f in (angle.cos(), angle.sin()))
    if cos.dim() == 3:  # each row its own positions (packed): broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    half = x.to(dtype)
    turned = torch.cat((-half[..., d // 2:], half[..., :d // 2]), dim=-1)
    return (half * cos + turned * sin).to(x.dtype)


def packed_documents(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed sequences (B, T), each document starting with BOS: every token's position in its own
    document (B, T), and the attention mask (B, 1, T, T), True where a query may see a key: its own
    document's, up to itself."""
    t = tokens.shape[1]
    at = torch.arange(t, device=tokens.device)
    begins = tokens == BOS
    positions = at - torch.cummax(torch.where(begins, at, 0), dim=1).values
    document = begins.cumsum(1)
    mask = (document[:, :, None] == document[:, None, :]) & (at[:, None] >= at[None, :])
    return positions, mask[:, None]


def causal(q, k, v):
    """Each position attends to itself and the positions before it."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


SHAPE = ("arch", "layers", "hidden", "heads", "kv_heads", "ffn", "tied")  # RunConfig's fields beside vocab, seq_len


@functools.cache
def _params(**args) -> int:
    """The parameters of Transformer(**args), counted on the meta device: once a shape (a GPU run's parent
    asks for its workload a hundred times, and a real width's meta model takes 0.1 s to build)."""
    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(**args).parameters())


def shaped(workload, vocab: int = 0, seq_len: int = 0, arch: str = "", layers: int = 0, hidden: int = 0,
           heads: int = 0, kv_heads: int = 0, ffn: int = 0, tied: bool = False, preset: str = ""):
    """The built-in transformer workload at the shape the planner's flags give (0 or "": the workload's
    own), checked; the preset's name, if any, in its description. A shape that cannot be built is one
    ConfigError line naming the flags."""
    if workload.make_module is not Transformer:
        raise ConfigError(f"--preset, --arch, --layers, --hidden, --heads, --kv-heads, --ffn, --tied and --vocab shape "
                          f"the built-in transformer; the {workload.name} workload has its own shape")
    base = dict(workload.model_args)
    args = {"vocab": vocab or base.get("vocab", 64), "context": seq_len or base.get("context", 32),
            "width": hidden or 128, "depth": layers or 2, "heads": heads or 4, "arch": arch or "gpt",
            "kv_heads": kv_heads, "ffn": ffn, "tied": tied}
    a = args
    if a["arch"] not in ARCHS:
        raise ConfigError(f"--arch {a['arch']}: gpt or llama")
    for flag, value, least in (("--vocab", a["vocab"], 2), ("--seq-len", a["context"], 1), ("--hidden", a["width"], 1),
                               ("--layers", a["depth"], 1), ("--heads", a["heads"], 1), ("--kv-heads", kv_heads, 0),
                               ("--ffn", ffn, 0)):
        if value < least:
            raise ConfigError(f"{flag} must be at least {least}, got {value}")
    if a["width"] % a["heads"] or a["heads"] % (kv_heads or a["heads"]):
        raise ConfigError(f"--hidden {a['width']} must divide into --heads {a['heads']}, and those into --kv-heads "
                          f"{kv_heads or a['heads']}")
    if a["arch"] == "llama" and (a["width"] // a["heads"]) % 2:
        raise ConfigError(f"--arch llama rotates pairs of features: a head's {a['width'] // a['heads']} must be even")
    if tied and a["arch"] != "gpt":
        raise ConfigError("--tied ties GPT's head to its token embedding; --arch llama's are separate")
    params = _params(**args)
    kv = f" ({kv_heads} kv)" if kv_heads and kv_heads != a["heads"] else ""
    name = f"{'GPT' if a['arch'] == 'gpt' else 'Llama'}-style transformer" + (f" ({preset})" if preset else "")
    description = (f"{name}, {a['depth']} blocks, width {a['width']}, {a['heads']} heads{kv}, {a['vocab']} tokens "
                   f"x {a['context']}, {params / 1e6:.1f}M params" + (", tied head" if tied else ""))
    return dataclasses.replace(workload, model_args=tuple(args.items()), classes=a["vocab"],
                               input_shape=(a["context"],), description=description,
                               tied="head.1.weight = embed.tokens.weight" if tied else "")
