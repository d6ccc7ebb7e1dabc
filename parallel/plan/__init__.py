"""The planner: which parallel layout for a model on a cluster, predicted (docs/planner.md)."""
