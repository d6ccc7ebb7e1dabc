"""A Hugging Face GPT-2, as transformers builds it, returned as it is (tiny config, random weights).

    pip install -e ".[hf]"        # transformers, an optional extra
    ./launch.sh compare --model examples/hf_gpt2.py:gpt2 --vocab 256 --seq-len 32 --batch-size 32

The factory returns the `GPT2LMHeadModel` itself: the harness takes `.logits` from its output. Its head
is tied to the token embedding, as in the released model. Dropout is set to 0 (GPT-2's default is 0.1):
with dropout every strategy draws other masks, and none could match one device; `gpt2_dropout` keeps
GPT-2's default, for seeing the verdict name it.
"""

from transformers import GPT2Config, GPT2LMHeadModel

CONFIG = dict(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)


def gpt2(vocab: int = 256, seq_len: int = 32):
    """The run's --vocab and --seq-len arrive as `vocab` and `seq_len`."""
    shape = {**CONFIG, "vocab_size": vocab, "n_positions": seq_len}
    return GPT2LMHeadModel(GPT2Config(**shape, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def gpt2_dropout(vocab: int = 256, seq_len: int = 32):
    return GPT2LMHeadModel(GPT2Config(**{**CONFIG, "vocab_size": vocab, "n_positions": seq_len}))
