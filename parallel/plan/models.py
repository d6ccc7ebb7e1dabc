"""The model a plan is for: a transformer's shape, from flags, a preset, or the user's own module.

Parameters and FLOPs are counted from the shape. FLOPs are model FLOPs as PaLM (appendix B) and Narayanan
et al. (2021, eq. 3 without its recomputation) count them: 2 per multiply-add of every weight matrix a
token passes (the embedding lookup is free; the output projection to the vocabulary counts) and 4 s h per
token per layer for the attention scores and their product with V, in full (no causal halving, which
Megatron's newer code applies and torchtitan does not). A training step is 3 forwards; recomputation's
extra forward is hardware FLOPs, not model FLOPs.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int = 0  # 0: 4 x hidden
    kv_heads: int = 0  # 0: heads (multi-head attention)
    experts: int = 0  # 0: a dense MLP
    top_k: int = 1
    arch: str = "gpt"  # gpt: GELU MLP, biases, learned positions, tied head; llama: SwiGLU, RMSNorm, untied
    name: str = ""
    tied: bool | None = None  # the head's weight is the token embedding; None: the arch's (gpt yes, llama no)

    def __post_init__(self):
        for field in ("layers", "hidden", "heads", "vocab", "seq"):
            if getattr(self, field) < 1:
                raise ValueError(f"--{field.replace('_', '-')} must be at least 1")
        for field in ("ffn", "kv_heads", "experts"):
            if getattr(self, field) < 0:
                raise ValueError(f"--{field.replace('_', '-')} must be 0 (the default) or more")
        if self.top_k < 1 or (self.experts and self.top_k > self.experts):
            raise ValueError(f"--top-k {self.top_k}: from 1 to the {self.experts or 'number of'} experts")
        if self.hidden % self.heads or self.heads % self.kv:
            raise ValueError(f"--hidden {self.hidden} must divide into --heads {self.heads}, and those into "
                             f"--kv-heads {self.kv}")
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"--arch {self.arch}: gpt or llama")
        if self.tied and self.arch != "gpt":
            raise ValueError("a tied head is gpt's (llama's is separate)")

    @property
    def F(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def gated(self) -> bool:
        return self.arch == "llama"

    @property
    def head_tied(self) -> bool:
        return self.arch == "gpt" if self.tied is None else self.tied

    @property
    def attention_params(self) -> int:
        h, kvd = self.hidden, self.hidden * self.kv // self.heads
        return 2 * h * h + 2 * h * kvd + (2 * h + 2 * kvd if self.arch == "gpt" else 0)

    @property
    def expert_params(self) -> int:
        """One MLP (one expert's)."""
        return (3 if self.gated else 2) * self.hidden * self.F + (self.F + self.hidden if self.arch == "gpt" else 0)

    @property
    def norm_params(self) -> int:
        return (4 if self.arch == "gpt" else 2) * self.hidden

    @property
    def layer_params(self) -> int:
        """Every parameter of one layer (all experts and the router)."""
        mlp = self.expert_params * max(1, self.experts) + (self.hidden * self.experts if self.experts else 0)
        return self.attention_params + mlp + self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token (and learned position) embeddings; the head too where it is not tied; the final norm."""
        pos = self.seq * self.hidden if self.arch == "gpt" else 0
        # a head of its own: its weight (and a gpt's bias, as compare's untied gpt has)
        head = 0 if self.head_tied else self.vocab * (self.hidden + (self.arch == "gpt"))
        return self.vocab * self.hidden + pos + head + self.norm_params // 2

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def active_params(self) -> int:
        """Parameters a token passes: top_k experts of each layer's."""
        if not self.experts:
            return self.params
        return self.params - self.layers * self.expert_params * (self.experts - self.top_k)

    def layer_matmul_flops(self, tokens: float) -> float:
        """Forward FLOPs of one layer's weight matrices (and router) on `tokens`, all experts' shares."""
        k = self.top_k if self.experts else 1
        mm = 2 * self.hidden * self.hidden + 2 * self.hidden * self.hidden * self.kv // self.heads
        mm += k * (3 if self.gated else 2) * self.hidden * self.F + self.hidden * self.experts
        return 2 * tokens * mm

    def core_flops(self, sequences: float, q_len: float) -> float:
        """Forward FLOPs of attention's scores and weighted sum, q_len queries against the whole sequence."""
        return 4 * sequences * q_len * self.seq * self.hidden

    def logits_flops(self, tokens: float) -> float:
        return 2 * tokens * self.hidden * self.vocab

    def model_flops(self, sequences: float) -> float:
        """Model FLOPs of a training step on `sequences`: 3 forwards (no recomputation)."""
        tokens = sequences * self.seq
        layer = self.layer_matmul_flops(tokens) + self.core_flops(sequences, self.seq)
        return 3 * (self.layers * layer + self.logits_flops(tokens))


def gpt(name, layers, hidden, heads, seq=2048, vocab=51200):
    return ModelShape(layers, hidden, heads, vocab, seq, name=name)


def llama(name, layers, hidden, heads, kv, ffn, vocab=128256, seq=8192, experts=0, top_k=1):
    return ModelShape(layers, hidden, heads, vocab, seq, ffn, kv, experts, top_k, "llama", name)


# Shapes from each model's paper or released config (Radford et al. 2019 table 2; Brown et al. 2020 table 2.1;
# Korthikanti et al. 2022
# table 3; Meta's Llama 3 model cards / config.json; Mistral's Mixtral 8x7B config.json).
PRESETS = {p.name: p for p in (
    gpt("gpt3-175b", 96, 12288, 96),
    gpt("megatron-22b", 48, 6144, 64),
    gpt("mt-nlg-530b", 105, 20480, 128),
    gpt("megatron-1t", 128, 25600, 160),
    gpt("gpt2-small", 12, 768, 12, seq=1024, vocab=50304),  # GPT-2's 50,257 tokens padded to 64s (nanoGPT's)
    gpt("gpt2-medium", 24, 1024, 16, seq=1024, vocab=50304),
    llama("llama3-8b", 32, 4096, 32, 8, 14336),
    llama("llama3-70b", 80, 8192, 64, 8, 28672),
    llama("llama3-405b", 126, 16384, 128, 8, 53248),
    llama("mixtral-8x7b", 32, 4096, 32, 8, 14336, vocab=32000, seq=4096, experts=8, top_k=2),
)}


def from_module(spec: str) -> dict:
    """FILE.py:FACTORY: the user's model built on the meta device (no memory), its shape read from its
    Hugging Face config (`model.config`) where it has one, else from its modules: the layers are the
    longest list of same-class blocks, the width their norm's, the vocabulary the largest embedding's,
    the sequence a position embedding's rows, the heads a block's head count or head size, the MLP's width
    its widest Linear out of the width. Returns the fields it read; the flags fill in (and override) the
    rest."""
    import torch

    from parallel.models.userload import call_factory, load_factory, resolve_factory

    spec = resolve_factory(spec)
    with torch.device("meta"):
        model = call_factory(load_factory(spec), 0, spec)["model"]
    c = getattr(model, "config", None)
    if c is not None and hasattr(c, "hidden_size"):
        gated = getattr(c, "hidden_act", "gelu") in ("silu", "swiglu")
        fields = {"layers": getattr(c, "num_hidden_layers", None), "hidden": c.hidden_size,
                  "heads": getattr(c, "num_attention_heads", None), "vocab": getattr(c, "vocab_size", None),
                  "seq": getattr(c, "max_position_embeddings", None),
                  "ffn": getattr(c, "intermediate_size", None), "kv_heads": getattr(c, "num_key_value_heads", None),
                  "experts": getattr(c, "num_local_experts", None), "top_k": getattr(c, "num_experts_per_tok", None),
                  "arch": "llama" if gated else "gpt"}
    else:
        fields = _read_modules(model)
    return {k: v for k, v in fields.items() if v is not None} | {"name": spec.rpartition("/")[2]}


def _read_modules(model) -> dict:
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, (nn.ModuleList, nn.Sequential)) and len(m) > 1
             and len({type(b) for b in m}) == 1 and any(True for _ in m[0].parameters())]
    blocks = max(lists, key=len, default=None)
    embeddings = sorted((m for m in model.modules() if isinstance(m, nn.Embedding)), key=lambda e: -e.num_embeddings)
    fields: dict = {"vocab": embeddings[0].num_embeddings if embeddings else None,
                    "seq": embeddings[1].num_embeddings if len(embeddings) > 1 else None}
    if blocks is None:
        return fields
    block = blocks[0]
    norms = [m for m in block.modules()
             if "norm" in type(m).__name__.lower() and getattr(m, "weight", None) is not None]
    hidden = norms[0].weight.shape[0] if norms else (embeddings[0].embedding_dim if embeddings else None)
    heads = None
    for m in block.modules():
        for name in ("num_heads", "n_head", "heads", "num_attention_heads"):
            if isinstance(getattr(m, name, None), int):
                heads = getattr(m, name)
        for name in ("head_size", "head_dim"):
            if isinstance(getattr(m, name, None), int) and hidden:
                heads = hidden // getattr(m, name)
    widths = [m.out_features for m in block.modules() if isinstance(m, nn.Linear) and m.in_features == hidden]
    return fields | {"layers": len(blocks), "hidden": hidden, "heads": heads,
                     "ffn": max(widths) if widths and max(widths) != hidden else None}


def add_shape_arguments(p) -> None:
    """compare's flags for its built-in transformer, plan's own names (--vocab and --seq-len, which a
    user's model shares, are usermodel's). A preset or --arch alone picks that workload."""
    g = p.add_argument_group("the built-in transformer's shape (as `plan` takes it; flags override a preset's "
                             "fields; a preset or --arch alone picks --workload transformer)")
    g.add_argument("--preset", default="", choices=sorted(n for n, m in PRESETS.items() if not m.experts),
                   help="a published model's shape (cut it with --layers)")
    g.add_argument("--arch", default="", choices=("gpt", "llama"), help="gpt: LayerNorm, GELU, learned positions; "
                   "llama: RMSNorm, SwiGLU, RoPE, grouped-query attention")
    for flag, what in (("layers", "blocks (2)"), ("hidden", "width (128)"), ("heads", "attention heads (4)"),
                       ("kv-heads", "k/v heads (default: --heads; fewer: grouped-query attention)"),
                       ("ffn", "the MLP's width (default 4 x hidden; llama 8/3 x hidden, rounded up to 64)")):
        g.add_argument(f"--{flag}", type=int, default=0, metavar="N", help=what)
    g.add_argument("--tied", action="store_true", help="gpt: the head's weight is the token embedding (GPT-2's, "
                                                       "and `plan`'s gpt); default separate")


def with_preset(given: dict) -> dict:
    """compare's arguments with a preset's shape filled in wherever a flag did not give that field."""
    if not given.get("preset"):
        return given
    m = PRESETS[given["preset"]]
    fields = {"arch": m.arch, "layers": m.layers, "hidden": m.hidden, "heads": m.heads, "kv_heads": m.kv_heads,
              "ffn": m.ffn, "vocab": m.vocab, "seq_len": m.seq}
    return given | {k: v for k, v in fields.items() if not given.get(k)}
