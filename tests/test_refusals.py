"""Issue 71: a refusal says what it found. Experts are found by structure (experts with a router beside them),
never by a class name; a norm with a weight per head beside the tensor-parallel split is named as one, with
what the split would need. Models from tiny transformers configs (no downloads) or written here."""

import pytest
import torch
from torch import nn

from parallel.models.tpplan import TPPlan
from parallel.models.transformer import MoETransformer
from parallel.models.userchecks import experts_of, routed_experts
from parallel.models.workloads import unhonoured_hf_plan

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0)
NOT_MOE = "are not parallel.models.moe.MoE layers, whose dispatch expert_parallel replaces (docs/experts.md)"
NONE = (False, "it has no parallel.models.moe.MoE layers (docs/experts.md)")


def hf(family: str, **sizes) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(family, **{**SMALL, **sizes})
    return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("family, sizes, block", [
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "MixtralSparseMoeBlock"),
    ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), "Qwen2MoeSparseMoeBlock")])
def test_a_transformers_mixture_of_experts_is_refused_naming_its_moe_blocks_not_its_attention(family, sizes, block):
    ok, why = experts_of(hf(family, **sizes))
    # transformers 5.24 fuses each block's experts: weights (4, out, in), beside a router weight (4, 64)
    assert not ok and why == f"its experts (model.layers.0.mlp and 1 more: {block}, 4 experts with a router) {NOT_MOE}"
    assert "Attention" not in why and "DecoderLayer" not in why  # what the class-name regex used to list


class ExpertMLP(nn.Module):  # named like an expert, and nothing more
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self.down(self.up(x).relu())


class MoeStack(nn.Module):  # blocks alike one after another, and a head: no router
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(ExpertMLP() for _ in range(3))
        self.head = nn.Linear(8, 10)


class Routed(nn.Module):  # experts with a router, under names that say nothing
    def __init__(self, fused: bool):
        super().__init__()
        self.pick = nn.Linear(8, 4)
        if fused:
            self.w = nn.Parameter(torch.zeros(4, 8, 16))  # (experts, in, hidden)
        else:
            self.branches = nn.ModuleList(nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 8)) for _ in range(4))


def test_a_class_named_like_an_expert_is_not_called_experts_and_a_router_beside_experts_is():
    assert experts_of(ExpertMLP()) == NONE
    assert experts_of(MoeStack()) == NONE
    assert experts_of(nn.Sequential(nn.Conv1d(4, 4, 3), nn.Linear(4, 4))) == NONE  # a kernel is no expert
    assert routed_experts(nn.Sequential(Routed(fused=False))) == ["0: Routed, 4 experts with a router"]
    assert routed_experts(nn.ModuleDict({"a": Routed(True), "b": Routed(True)})) == [
        "a and 1 more: Routed, 4 experts with a router"]
    ok, why = experts_of(Routed(fused=True))
    assert not ok and why == f"its experts (the model: Routed, 4 experts with a router) {NOT_MOE}"
    assert experts_of(MoETransformer(experts=4)) == (True, "")  # the project's own: split by expert_parallel
    assert routed_experts(MoETransformer(experts=4))[0].endswith(": MoE, 4 experts with a router")


def colwise_plan(model: nn.Module) -> dict:
    """transformers' plan of `model` for its attention and MLP, every split plain colwise or rowwise."""
    return {k: v.partition("_")[0] for k, v in model.tp_plan.items() if ".layers." in k}


def test_a_norm_with_a_weight_per_head_beside_the_split_is_named_with_what_the_split_needs():
    """Cohere's q_norm (use_qk_norm) is a LayerNorm over each head, weight (heads, head_dim), which transformers
    5.24's own plan leaves unmarked; OLMo2's is an RMSNorm over q_proj's whole output, heads x head_dim wide
    (its plan gathers q_proj's output: read as plainly colwise here). Replicated, neither can be right with a
    summed gradient, as Qwen3's (head_dim,) one, applied alike to every head, is."""
    cohere = hf("cohere", use_qk_norm=True)
    assert tuple(cohere.model.layers[0].self_attn.q_norm.weight.shape) == (4, 16)
    assert unhonoured_hf_plan(cohere.tp_plan, cohere) == (
        "leaves model.layers.0.self_attn.q_norm, a per-head norm (4 heads x 16) after q_proj, replicated: tensor "
        "parallelism would need it split by heads like q_proj (each rank keeps its heads' rows), not its gradient "
        "summed")
    olmo2 = hf("olmo2")
    assert unhonoured_hf_plan(colwise_plan(olmo2), olmo2) == (
        "leaves model.layers.0.self_attn.q_norm, a norm over all 4 heads of q_proj's output (4 x 16), replicated: "
        "tensor parallelism would need it split by heads like q_proj (each rank keeps its heads' part) and its "
        "statistics summed over the ranks (or q_proj's output gathered first), not its gradient summed")
    qwen3 = hf("qwen3", head_dim=16)
    unmarked = {k: v for k, v in colwise_plan(qwen3).items() if v in ("colwise", "rowwise")}
    assert unhonoured_hf_plan(unmarked, qwen3).startswith(
        "leaves model.layers.0.self_attn.q_norm, a weight beside its split layers, replicated, without its gradient")


class HeadNormed(nn.Module):
    """Attention's projections with a per-head norm between, weight (heads, head_dim), in plain torch."""

    def __init__(self, heads: int = 4, head_dim: int = 8):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.q_proj, self.o_proj = nn.Linear(32, heads * head_dim), nn.Linear(heads * head_dim, 32)
        self.q_norm = nn.LayerNorm((heads, head_dim))  # over heads and head_dim together: one norm, whole width

    def forward(self, x):
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.heads, self.head_dim)))  # (B, T, heads, head_dim)
        return self.o_proj(q.flatten(-2))


def test_a_two_dimensional_norm_over_every_head_at_once_is_not_called_per_head():
    model = nn.Sequential(HeadNormed())
    why = unhonoured_hf_plan({"0.q_proj": "colwise", "0.o_proj": "rowwise"}, model)
    assert why.startswith("leaves 0.q_norm, a norm over all 4 heads of q_proj's output (4 x 8), replicated"), why
    assert TPPlan(("0.q_proj",), ("0.o_proj",)).summed == ()  # nothing summed: the plan the refusal stands for
