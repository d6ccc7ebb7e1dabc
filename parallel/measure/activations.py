"""Activation memory of one transformer layer: the formula beside what autograd really keeps.

Korthikanti et al. (2022) count sbh(34 + 5as/h) bytes per layer (16-bit, with dropout). Adapted to this
project's block (workloads.Block: fp32, pre-norm, GELU MLP of 4h, no dropout), with s positions, b
sequences, h features, a heads, 4-byte elements, each tensor counted once however often it is saved:

    whole     16 sbh   the two norms' inputs and the column-parallel layers' input (norm1(x) for q, k, v;
                       norm2(x) for mlp.0): tensor parallelism leaves them whole, sequence parallelism
                       splits them over its t ranks
    split     48 sbh   q, k, v, proj's input (the heads' output), GELU's input and output: 1/t each under
                       tensor parallelism
    core      4 as^2 b the softmax of the math attention kernel, 1/t under tensor parallelism; the fused
              (4 abs)  kernels keep their log-sum-exp instead (a b s floats), and no s^2 term at all
    norms     16 sb    each norm's mean and 1/std (the paper leaves them out: 1/h of the rest)

so sbh(64 + 4as/h) with the math kernel and 64 sbh (+ the log-sum-exp) with the fused one. Recomputation:
"selective" (the attention core recomputed in backward) drops the core; "full" (the whole layer) keeps
only its input, sbh. Context parallelism gives each rank s/cp positions.

`LayerMeter` measures it: the bytes autograd saves during one forward of a model's first Block, each
storage counted once (q, k and v save the same input three times; the pipelines' ActivationMeter counts
every save). The worker runs it for the strategies that declare LAYER_ACTIVATIONS (single, the context-
parallel ones) and those of one tensor-parallel group (measure/layers.py): one more forward of one block,
after the run, off the clock; the report's table of it is measure/layers.py's.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from parallel.kit.ulysses import Ulysses
from parallel.measure.formulas import element_bytes
from parallel.world.dist import local

BYTES = 4  # fp32


def formula(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, kernel: str = "fused",
            recompute: str = "none", elem: int = BYTES, dropout: bool = False, kv: float = 1.0, ffn: float = 4.0,
            gated: bool = False, stats: int = BYTES, turned: bool = False) -> dict[str, float]:
    """The named terms, in bytes, of one layer on one rank (`s`: the positions this rank's layer sees
    outside its split regions; `t`: tensor-parallel ranks; `sp`: sequence parallel). Their sum is the
    prediction. The defaults are this project's block; the planner (parallel/plan) gives Megatron's:
    `elem` 2 (16-bit), `dropout` (a 1-byte mask after attention, after the MLP and on the softmax: the
    paper's 34 sbh + 5 as^2 b), `kv` the share of K, V heads (grouped-query attention), `ffn` the MLP's
    width over h and `gated` (SwiGLU keeps gate, up and their product); `stats` the bytes of a norm's
    statistics and the attention's log-sum-exp (fp32, but 8 under --precision fp64); `turned`: Ulysses'
    all-to-all (kit/ulysses.py) keeps the heads' output twice, at every position of its heads (attention's)
    and at its own positions of every head (the projection's input), sbh more."""
    sbh = s * b * h
    if recompute == "full":
        return {"input": elem * sbh / (t if sp else 1)}
    whole = t if sp else 1
    kept = 1 + 2 * kv + 1 + (3 if gated else 2) * ffn  # q, k, v, the heads' output, the MLP's inner tensors
    terms = {"whole": (4 * elem + 2 * dropout) * sbh / whole, "split": kept * elem * sbh / t,
             "norms": 4 * stats * s * b / whole}
    if turned and recompute == "none":  # selective: attention's output is recomputed, not kept
        terms["a2a"] = elem * sbh / t
    if recompute == "none":
        softmax = elem + (1 + elem) * dropout  # its output (and the dropout's mask and output)
        terms["core"] = softmax * a * s * s * b / t if kernel == "math" else stats * a * s * b / t
    return terms


def _turned_lse(shape: tuple, b: int, heads: int, positions: int) -> bool:
    """A log-sum-exp of fewer heads over more positions (b, heads / U, s U): Ulysses' attention."""
    return (len(shape) in (3, 4) and shape[0] == b and shape[1] * shape[2] == heads * positions
            and shape[1] < heads and shape[3:] in ((), (1,)))


def block_of(model: nn.Module) -> nn.Module | None:
    """The model's first transformer Block whose MLP is the dense one the formula counts (an MoE
    block's is not), or None."""
    from parallel.models.transformer import Block

    for m in model.modules():
        if isinstance(m, Block) and isinstance(m.mlp, nn.Sequential):
            return m
    return None


def meter_for(strategy, model: nn.Module, workload, config) -> LayerMeter | None:
    """A LayerMeter on the model's first block, where the strategy declares LAYER_ACTIVATIONS, the workload
    is a token model and the run measures its extras."""
    if not (strategy.LAYER_ACTIVATIONS and config.extras and getattr(workload, "data", None) == "tokens"):
        return None
    if getattr(workload, "tokens", "even") == "packed":  # its block re-run alone would have no document mask
        return None
    block = block_of(model)
    return LayerMeter(block) if block is not None else None


class LayerMeter:
    """The activation bytes of one forward of `block`, each storage once, parameters left out: the
    shape and layout of the block's input are taken from its first call in training (a hook, removed
    then), and `measure()`, after the run, on every rank alike (its forward may hold collectives: tensor
    and context parallelism), runs the block once more on an input like it with the saves counted, then
    drops the graph. `shapes`: every saved
    tensor's shape, for naming the one that makes a difference."""

    def __init__(self, block: nn.Module):
        self.block, self.bytes, self.shapes, self.input, self.kernel = block, None, [], None, "fused"
        self._storages: dict[int, int] = {}
        self._params = {local(p).data_ptr() for p in block.parameters()}
        self._handle = block.register_forward_pre_hook(self._keep)
        self._layout = None  # a DTensor input's (mesh, placements)

    def _keep(self, module, args):
        """The input's shape, dtype, device (and DTensor layout): which tensors a forward saves, and their
        sizes, do not depend on its values, so none are kept (the run's peak memory stays its own)."""
        x = args[0]
        if hasattr(x, "to_local"):
            self._layout = (x.device_mesh, x.placements)
        self.input = torch.empty_like(local(x), device="meta")
        self._device = local(x).device
        self._handle.remove()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        held = local(t)
        if held.data_ptr() not in self._params:
            storage = held.untyped_storage()
            if storage.data_ptr() not in self._storages:
                self.shapes.append(tuple(held.shape))  # each storage's first saved shape
            self._storages[storage.data_ptr()] = storage.nbytes()
        return t

    def measure(self, recompute: str = "none") -> None:
        """`recompute`: "full", the block under torch.utils.checkpoint; "selective", its attention core
        (Attention.attend) under it. Reentrant checkpoints: they keep their inputs through the saved-
        tensor hooks this meter reads (the non-reentrant ones keep the same inputs out of their sight)."""
        from torch.utils.checkpoint import checkpoint

        self._handle.remove()
        if self.input is None:
            return
        x = torch.randn(self.input.shape, dtype=self.input.dtype, device=self._device, requires_grad=True)
        if self._layout is not None:
            from torch.distributed.tensor import DTensor

            x = DTensor.from_local(x, *self._layout, run_check=False)
        attn, attend = self.block.attn, self.block.attn.attend
        if recompute == "selective":
            attn.attend = lambda q, k, v: checkpoint(attend, q, k, v, use_reentrant=True)
        try:
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                out = checkpoint(self.block, x, use_reentrant=True) if recompute == "full" else self.block(x)
            del out
        finally:
            attn.attend = attend
        # a fused kernel keeps a log-sum-exp of (b, heads, s), (b, heads, s, 1) or (CUDA's memory-efficient
        # one) s padded to 32; the math one keeps none
        b, s_in, mine = self.input_shape[0], self.input_shape[1], self.heads()[1]
        lse = {(b, mine, s_in), (b, mine, s_in, 1), (b, mine, -(-s_in // 32) * 32)}
        fused = any(x in lse or _turned_lse(x, b, mine, s_in) for x in self.shapes)
        self.kernel = "recomputed" if recompute != "none" else "fused" if fused else "math"
        self.bytes = sum(self._storages.values())

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(local(self.input).shape)

    def heads(self) -> tuple[int, int]:
        """(heads of the whole layer, heads this rank computes): the input's width and q's local rows,
        over the head size."""
        attn = self.block.attn
        return self.input_shape[-1] // attn.head_size, local(attn.q.weight).shape[0] // attn.head_size

    def details(self, seq_len: int, precision: str = "fp32", recompute: str = "none") -> dict:
        """Measured (a collective: `measure` on every rank) beside the formula, for results.json: t from
        the heads this rank holds, sequence parallel where the block's input holds 1/t of the positions
        under tensor parallelism, context parallel (cp) where it holds fewer without it. The formula
        counts 4-byte elements (8 under fp64): under bf16 only the measurement is given."""
        self.measure(recompute)
        if self.bytes is None:
            return {}
        if precision == "bf16":
            return {"layer_activation_bytes": self.bytes}
        elem = element_bytes(precision)
        b, s_in, h = self.input_shape
        a, mine = self.heads()
        t = a // mine
        sp = t > 1 and s_in * t == seq_len
        cp = seq_len // s_in if t == 1 else 1
        s = s_in * t if sp else s_in  # the positions inside the split regions
        turned = isinstance(self.block.attn.attend, Ulysses)  # formula keeps its term without recomputation only
        terms = formula(s, b, h, a, t, sp, self.kernel, recompute, elem=elem, stats=elem, turned=turned)
        gathered = [x for x in self.shapes if sp and x[-1] == h and math.prod(x[:-1]) == b * seq_len]
        return {"layer_activation_bytes": self.bytes, "layer_activation_terms": terms,
                "layer_activation_gathered": len(gathered),  # saved whole-sequence (b, s, h) under SP
                "layer_activation_predicted": sum(terms.values()),
                "layer_activation_layout": {"s": s, "b": b, "h": h, "a": a, "t": t, "sp": sp, "cp": cp,
                                            "kernel": self.kernel, "recompute": recompute}}
