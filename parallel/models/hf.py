"""A Hugging Face decoder (GPT-2, Llama, Qwen2, Mistral, Mixtral, ... as `...ForCausalLM`) cut into the
pipelines' layers, with no stage written by hand:

    input_ids -> [Embeddings] -> [Block 0] -> ... -> [Block n-1] -> [final norm] -> [head] -> logits
                 token (+ position) embeddings; a block with the extra inputs the model's forward gives it

The pipelines pass one tensor from layer to layer; a decoder's blocks take more (the rotary embeddings'
cos and sin, the causal mask, position ids). Those depend only on the sequence length, so they are
recorded once, from the model's own forward on a sample, and kept beside each block (`Block`: buffers
that move with it, outside the state dict). Recorded at two batch sizes and two contents: an input that
differs between them (a padding mask, say) cannot be recorded, and the model is refused with its name.
A KV cache the model would build is not kept (`use_cache` off): training never reads one.

Only the structure transformers gives every decoder is used: get_input_embeddings(), the base model's
ModuleList of blocks, the final norm after it, get_output_embeddings(). The harness (usermodel) then
runs the layers one after another on a sample and compares with the model's own forward; any other
shape of model (an encoder, scaled embeddings, logits post-processed) fails there and is refused with
the reason.
"""

from __future__ import annotations

import torch
from torch import nn

KEPT = "_parallel_layers"  # the layers, made once per model instance (their recorded inputs with them)


class Embeddings(nn.Module):
    """The token embedding, plus a learned position embedding where the model has one (GPT-2's wpe),
    then the model's embedding dropout."""

    def __init__(self, tokens: nn.Module, positions: nn.Module | None, dropout: nn.Module | None, owners: dict):
        super().__init__()
        self.tokens, self.positions, self.dropout = tokens, positions, dropout
        self.owners = owners  # attribute -> the model's name of that module (pipeline_dist's state dict)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(torch.arange(ids.shape[1], device=ids.device))
        return h if self.dropout is None else self.dropout(h)


class _Recorded:
    """A recorded tensor input, kept as the Block's buffer `name`; `batched`: its first dimension was the
    batch (each row the same), expanded to the batch it is called with."""

    def __init__(self, name: str, batched: bool):
        self.name, self.batched = name, batched


class Block(nn.Module):
    """One decoder block called as the model's forward calls it: the hidden states, then the recorded
    extra inputs (positional and keyword)."""

    def __init__(self, block: nn.Module, name: str, args: tuple, kwargs: dict, tensors: dict[str, torch.Tensor]):
        super().__init__()
        self.block, self.owners = block, {"block": name}
        self.args, self.kwargs = args, kwargs  # as record() gives them: tensors replaced by _Recorded names
        for buffer, t in tensors.items():
            self.register_buffer(buffer, t, persistent=False)

    def _given(self, value, batch: int):
        if isinstance(value, tuple):
            return tuple(self._given(v, batch) for v in value)
        if isinstance(value, dict):
            return {k: self._given(v, batch) for k, v in value.items()}
        if isinstance(value, _Recorded):
            t = self._buffers[value.name]
            return t.expand(batch, *t.shape[1:]) if value.batched else t
        return value

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b = h.shape[0]
        out = self.block(h, *self._given(self.args, b), **self._given(self.kwargs, b))
        return out[0] if isinstance(out, tuple) else out  # transformers < 5 returned (hidden, ...)


def is_decoder(model: nn.Module) -> bool:
    """A transformers model with a base model and an output head: a ...ForCausalLM."""
    base = getattr(model, "base_model", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return isinstance(base, nn.Module) and base is not model and isinstance(head, nn.Module)


def decoder_layers(model: nn.Module, seq_len: int) -> tuple[list[nn.Module], str]:
    """(the layers, "") or ([], why not): made once per model instance and kept on it, so that every
    caller (the cut, the stages) gets the same modules."""
    if KEPT in model.__dict__:
        return model.__dict__[KEPT], ""
    layers, why = _make(model, seq_len)
    if layers:
        model.__dict__[KEPT] = layers  # a plain attribute: not a submodule, not in the state dict
    return layers, why


def _make(model: nn.Module, seq_len: int) -> tuple[list[nn.Module], str]:
    base = model.base_model
    prefix = next(n for n, m in model.named_modules() if m is base)
    lists = [(n, c) for n, c in base.named_children() if isinstance(c, nn.ModuleList)]
    if len(lists) != 1:
        return [], f"its base model {type(base).__name__} has {len(lists)} lists of blocks, not one"
    where, blocks = lists[0]
    before, after, seen = [], [], False
    for n, c in base.named_children():
        if c is blocks:
            seen = True
        elif any(True for _ in c.parameters()):  # parameter-less ones (rotary embeddings) are recorded
            (after if seen else before).append((n, c))
        elif isinstance(c, nn.Dropout):
            before.append((n, c))
    tokens = model.get_input_embeddings()
    drops = [(n, c) for n, c in before if isinstance(c, nn.Dropout)]
    embeds = [(n, c) for n, c in before if not isinstance(c, nn.Dropout)]
    others = [(n, c) for n, c in embeds if c is not tokens]
    if len(embeds) - len(others) != 1 or len(others) > 1 or any(not isinstance(c, nn.Embedding) for _, c in others):
        return [], (f"before its blocks it has {', '.join(n for n, _ in before) or 'nothing'}, not the token "
                    "embedding alone (or with a position embedding)")
    if len(after) != 1:
        return [], (f"after its blocks it has {', '.join(n for n, _ in after) or 'nothing'}, not one final norm")
    def full(n: str) -> str:  # a child of the base model, named in the whole model
        return f"{prefix}.{n}" if prefix else n

    owners = {"tokens": full(next(n for n, c in embeds if c is tokens)),
              **({"positions": full(others[0][0])} if others else {}),
              **({"dropout": full(drops[0][0])} if drops else {})}
    try:
        recorded = record(model, blocks, seq_len)
    except ValueError as e:
        return [], str(e)
    layers = [Embeddings(tokens, others[0][1] if others else None, drops[0][1] if drops else None, owners)]
    for i, (block, (args, kwargs, tensors)) in enumerate(zip(blocks, recorded, strict=True)):
        layers.append(Block(block, full(f"{where}.{i}"), args, kwargs, tensors))
    return [*layers, after[0][1], model.get_output_embeddings()], ""


def _capture(model: nn.Module, blocks: nn.ModuleList, ids: torch.Tensor) -> list[tuple[tuple, dict]]:
    seen = []
    hooks = [b.register_forward_pre_hook(lambda m, a, k: seen.append((a[1:], dict(k))), with_kwargs=True)
             for b in blocks]
    was = model.training
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            model.eval()
            model(ids)
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    return seen


def record(model: nn.Module, blocks: nn.ModuleList, seq_len: int) -> list[tuple[tuple, dict, dict]]:
    """Each block's extra inputs as the model's forward gives them, (args, kwargs, buffers): tensors
    replaced by _Recorded names of `buffers`. Raises ValueError naming an input that depends on the batch."""
    from transformers.cache_utils import Cache

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    a = _capture(model, blocks, torch.zeros(2, seq_len, dtype=torch.long, device=device))
    b = _capture(model, blocks, torch.arange(3 * seq_len, device=device).reshape(3, seq_len) % vocab)
    out = []
    for i, ((args, kwargs), (args_b, kwargs_b)) in enumerate(zip(a, b, strict=True)):
        tensors: dict[str, torch.Tensor] = {}

        def keep(name, x, y, i=i, tensors=tensors):
            if isinstance(x, Cache) or name == "past_key_values":
                return None  # a KV cache: generation's, never read in training
            if name == "use_cache":
                return False
            if isinstance(x, (tuple, list)):
                return tuple(keep(f"{name}_{j}", u, v) for j, (u, v) in enumerate(zip(x, y, strict=True)))
            if not isinstance(x, torch.Tensor):
                return x
            # on the meta device (a model built to be looked at: its layers counted) there are no values to
            # compare: an input of the same shape both times is taken as fixed, one sized by the batch as batched
            if x.shape == y.shape and (x.is_meta or torch.equal(x, y)):
                tensors[name] = x
                return _Recorded(name, batched=False)
            if (x.shape[0], y.shape[0]) == (2, 3) and x.shape[1:] == y.shape[1:] and (
                    x.is_meta or torch.equal(x[:1].expand_as(y), y)):
                tensors[name] = x[:1].clone()
                return _Recorded(name, batched=True)
            raise ValueError(f"block {i}'s input {name!r} changes with the batch's contents, so it cannot be "
                             "recorded once")

        out.append((tuple(keep(f"arg{j}", x, y) for j, (x, y) in enumerate(zip(args, args_b, strict=True))),
                    {k: keep(k, v, kwargs_b[k]) for k, v in kwargs.items()}, tensors))
    return out
