"""parallel: every way to spread PyTorch training over several devices, compared on one model."""

__version__ = "0.1.0"
