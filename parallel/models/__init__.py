"""What a run trains: the built-in workloads and models, their synthetic data, Hugging Face decoders, tensor-
parallel plans, and a user's own model and data, loaded and checked."""
