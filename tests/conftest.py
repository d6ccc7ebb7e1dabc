import sys
from pathlib import Path

import pytest
import torch

from parallel.config import RunConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def small():
    """A validated config small enough to train in well under a second."""

    def make(**kw) -> RunConfig:
        base = {"workload": "cnn", "batch_size": 32, "steps": 4, "warmup": 1, "devices": "cpu:2"}
        return RunConfig(**{**base, **kw}).validate()

    return make


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def python() -> str:
    return sys.executable
