"""Two dimensions at once: FSDP beside tensor, pipeline or context parallelism, on a 2-D device mesh."""
