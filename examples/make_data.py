"""Token data as users bring it, for `--data`: documents padded to the sequence with Hugging Face's -100
labels, or one flat token file as nanoGPT's prepare.py writes `train.bin`.

    python examples/make_data.py padded /tmp/padded.pt                  # {"x", "y"}: the first samples padded
    python examples/make_data.py padded /tmp/later.pt --padding later   # ... the first samples full length
    python examples/make_data.py bin /tmp/train.bin                     # uint16 tokens, no header
    python examples/make_data.py npy /tmp/padded.npy                    # int32, each document padded with -100
    ./launch.sh compare --model examples/hf_llama.py:llama --data /tmp/padded.pt --strategies all \\
        --batch-size 32 --check-replicas

examples/data/ holds one of each, made by this script: padded.pt (`padded --samples 512`), train.bin
(`bin --tokens 40000`) and padded_tokens.npy (`npy --tokens 4096`).

padded: each sample a document of 2 to T + 1 tokens (x its first tokens, y the next ones) padded to T:
x holds the pad token 0 and y holds -100 (cross-entropy's ignore_index) where the next token is padding.
`--padding first` pads the first half of the samples and leaves the rest full length; `later` the other
way round; `every` pads every sample. bin: documents one after another, each ending in token 0 (nanoGPT's
<|endoftext|> is its tokenizer's last id; any id works), as np.uint16 written with tofile. npy: documents
one after another as int32, each padded with -100 to the next multiple of T (no target there; as an input
the harness reads it as token 0).
The tokens follow a fixed random chain of likely successors, so the loss falls as a model learns it.
"""

import argparse

import numpy as np
import torch


def documents(rng: np.random.Generator, vocab: int, lengths: np.ndarray) -> list[np.ndarray]:
    """One document per length: a walk where each token is one of 4 likely successors of the last (0.8)."""
    likely = np.random.default_rng(1234).integers(1, vocab, (vocab, 4))  # the chain: the same for every file
    out = []
    for n in lengths:
        doc = np.empty(n, dtype=np.int64)
        doc[0] = rng.integers(1, vocab)
        for i in range(1, n):
            doc[i] = likely[doc[i - 1], rng.integers(4)] if rng.random() < 0.8 else rng.integers(1, vocab)
        out.append(doc)
    return out


def padded(samples: int, vocab: int, seq_len: int, padding: str, seed: int) -> dict[str, torch.Tensor]:
    rng = np.random.default_rng(seed)
    half = np.arange(samples) < samples // 2
    pad = {"first": half, "later": ~half, "every": np.ones(samples, bool)}[padding]
    lengths = np.where(pad, rng.integers(2, seq_len + 1, samples), seq_len + 1)  # tokens, the target after included
    x = torch.zeros(samples, seq_len, dtype=torch.long)
    y = torch.full((samples, seq_len), -100, dtype=torch.long)
    for i, doc in enumerate(documents(rng, vocab, lengths)):
        x[i, : len(doc) - 1] = torch.from_numpy(doc[:-1])
        y[i, : len(doc) - 1] = torch.from_numpy(doc[1:])
    return {"x": x, "y": y}


def flat(tokens: int, vocab: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = documents(rng, vocab, rng.integers(8, 200, tokens // 8 + 1))
    return np.concatenate([np.append(d, 0) for d in docs])[:tokens].astype(np.uint16)


def padded_flat(tokens: int, vocab: int, seq_len: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    docs = documents(rng, vocab, rng.integers(2, 2 * seq_len, tokens // seq_len + 1))
    blocks = [np.concatenate((d, np.full(-len(d) % seq_len, -100))) for d in docs]
    return np.concatenate(blocks)[:tokens].astype(np.int32)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", choices=("padded", "bin", "npy"))
    p.add_argument("out")
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--samples", type=int, default=1024, help="padded: samples (rows)")
    p.add_argument("--tokens", type=int, default=100_000, help="bin, npy: tokens in the file")
    p.add_argument("--padding", choices=("first", "later", "every"), default="first")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.kind == "padded":  # int16 where the vocabulary fits: a quarter of the file (the harness reads int64)
        data = padded(a.samples, a.vocab, a.seq_len, a.padding, a.seed)
        torch.save({k: v.short() if a.vocab <= 2**15 else v for k, v in data.items()}, a.out)
    elif a.kind == "bin":
        flat(a.tokens, a.vocab, a.seed).tofile(a.out)
    else:
        np.save(a.out, padded_flat(a.tokens, a.vocab, a.seq_len, a.seed))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
