"""Hugging Face causal-LM families as transformers builds them, through its auto classes, returned as they
are (tiny configs, random weights): the corpus the suite runs (tests/test_hf_corpus.py, docs/your-model.md).

    ./launch.sh compare --model examples/hf_families.py:mixtral --vocab 256 --seq-len 32 --batch-size 32

One factory a family (its model_type in transformers): gpt2 and opt (learned positions; GPT-2's head tied),
llama, mistral, qwen2, qwen3 (norms on q and k), phi3 (a fused qkv), gemma2 (scaled embeddings, soft-capped
logits, a tied head), gpt_neox and falcon (attention and MLP side by side), mixtral and qwen2_moe (routed
experts; Qwen2-MoE's with a shared one). Each at width 64, 2 blocks, 4 heads (2 key/value heads where the
family has grouped-query attention), dropout 0 where the default has it (GPT-2's and OPT's: with dropout on, no
strategy can match one device, and the comparison says so); --vocab and --seq-len arrive as `vocab` and
`seq_len`.
"""

from transformers import AutoConfig, AutoModelForCausalLM

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
FAMILIES = {  # model_type -> what it needs beyond SMALL (or instead of it)
    "gpt2": dict(n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # its default 0.1: then nothing could match
    "opt": dict(ffn_dim=128, word_embed_proj_dim=64, dropout=0.0),  # functional dropout, 0.1 by default
    "llama": {}, "mistral": {}, "qwen2": {}, "qwen3": dict(head_dim=16), "phi3": {}, "gemma2": dict(head_dim=16),
    "gpt_neox": dict(rotary_pct=0.25), "falcon": dict(new_decoder_architecture=False),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
}


def build(family: str, vocab: int = 256, seq_len: int = 32):
    """The family's model from a tiny config, as AutoModelForCausalLM makes it."""
    if family == "gpt2":
        sizes = {**FAMILIES[family], "vocab_size": vocab, "n_positions": seq_len}
    else:
        sizes = {**SMALL, **FAMILIES[family], "vocab_size": vocab, "max_position_embeddings": seq_len}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **sizes))


def _factory(family: str):
    def factory(vocab: int = 256, seq_len: int = 32):
        return build(family, vocab, seq_len)

    factory.__name__ = family
    return factory


globals().update({family: _factory(family) for family in FAMILIES})
