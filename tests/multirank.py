"""Spawned gloo ranks inside pytest: the package's own runner (parallel/harness/ranks.py)."""

from parallel.harness.ranks import RankError, run_ranks

__all__ = ["RankError", "run_ranks"]
