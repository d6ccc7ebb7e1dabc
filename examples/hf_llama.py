"""A Hugging Face Llama, as transformers builds it, returned as it is (tiny config, random weights).

    pip install -e ".[hf]"        # transformers, an optional extra
    ./launch.sh compare --model examples/hf_llama.py:llama --vocab 256 --seq-len 32 --batch-size 32

Llama's shape: no biases, RMSNorm, rotary position embeddings computed inside the model, grouped-query
attention (here 4 query heads sharing 2 key/value heads), a SwiGLU MLP, an untied head.
"""

from transformers import LlamaConfig, LlamaForCausalLM

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=0)


def llama(vocab: int = 256, seq_len: int = 32):
    """The run's --vocab and --seq-len arrive as `vocab` and `seq_len`."""
    return LlamaForCausalLM(LlamaConfig(**{**CONFIG, "vocab_size": vocab, "max_position_embeddings": seq_len}))
