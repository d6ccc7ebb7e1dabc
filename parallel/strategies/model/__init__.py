"""Model parallelism: the ranks split one batch's work, by its matrices (tensor), its layers (pipelines), its
sequence (context) or its experts."""
