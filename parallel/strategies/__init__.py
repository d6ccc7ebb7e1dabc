"""The strategy registry. Each strategy is one module with the same small surface:

    NAME = "ddp"                     # what the CLI and the report call it
    LAUNCH = "torchrun"              # "inprocess" | "torchrun" | "hogwild": how the harness starts it
    SYNCHRONOUS = True               # must match `single` within the equivalence tolerance
    def setup(model, make_optimizer, loss_fn, dist, config) -> Trainable
    def train_step(trainable, batch, dist) -> loss tensor   # one optimiser step on this rank's share

and may override the defaults below (world_size, check, device_kind, state_dict, ...). The harness
only ever talks to `Strategy`; it never branches on a strategy's name.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from parallel.errors import ConfigError

# The report lists strategies in this order; `single` is the baseline and always first.
NAMES = ["single"]


def _defaults() -> dict:
    from parallel.strategies import base

    return {
        "world_size": base.world_size,
        "check": base.check,
        "device_kind": base.device_kind,
        "state_dict": base.state_dict,
        "comm_bytes_predicted": base.comm_bytes_predicted,
        "NOT_EXPECTED_REASON": None,
    }


class Strategy:
    """A strategy module with every optional hook filled in by its default."""

    def __init__(self, module: ModuleType):
        self.module = module
        self.name: str = module.NAME
        self.launch: str = module.LAUNCH
        self.synchronous: bool = module.SYNCHRONOUS
        first = (module.__doc__ or "").strip().splitlines()[0]
        self.description: str = first.removeprefix(f"{self.name}: ")
        for attr, default in _defaults().items():
            setattr(self, attr, getattr(module, attr, default))
        self.setup = module.setup
        self.train_step = module.train_step

    def __repr__(self) -> str:
        return f"Strategy({self.name})"


def get(name: str) -> Strategy:
    if name not in NAMES:
        raise ConfigError(f"unknown strategy {name!r}; valid strategies: {', '.join(NAMES)}")
    return Strategy(importlib.import_module(f"parallel.strategies.{name}"))


def parse_list(text: str) -> list[str]:
    """`a,b` -> ["a", "b"], validated, duplicates dropped; `all` -> every strategy."""
    names = NAMES if text.strip() == "all" else [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ConfigError(f"--strategies is empty; valid strategies: {', '.join(NAMES)}")
    for n in names:
        get(n)
    return list(dict.fromkeys(names))
