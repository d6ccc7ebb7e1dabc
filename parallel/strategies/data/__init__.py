"""Data parallelism: every rank runs the whole model on its share of the batch; what differs is how gradients meet
(by hand, DDP, Hogwild) and what each rank keeps (ZeRO, FSDP)."""
