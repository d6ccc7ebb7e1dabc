"""The GPU basics readers ask about before multi-device training, each runnable on any machine:
device memory (memory.py), timing GPU work correctly (bench.py), CUDA streams (streams.py), and ways
to fit more in memory (savers.py). `python -m parallel bench ...` runs them."""
