"""Distributed state: one small dataclass built once (from torchrun's environment, or given), passed
explicitly. Nothing else in the package reads os.environ for it. The backend follows the device here and
nowhere else: cuda -> nccl, cpu -> gloo."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as td

from parallel.devices import DeviceSpec
from parallel.errors import ConfigError


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def torchrun_auto_devices(text: str, env: Mapping[str, str] | None = None) -> str:
    """`auto` under `torchrun --nproc_per_node=N` on a machine without CUDA means cpu:N, so the
    standard launch line needs no --devices; anything else is left as given."""
    env = os.environ if env is None else env
    local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
    if text == "auto" and local_world > 1 and not torch.cuda.is_available():
        return f"cpu:{local_world}"
    return text


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    launched: bool = False  # started by torchrun (its rendezvous variables are set)
    master: tuple[str, int] = ("", 0)  # where the workers' store is (MASTER_ADDR, MASTER_PORT)
    agent_store: bool = False  # torchrun's agent already hosts that store (TORCHELASTIC_USE_AGENT_STORE)
    restart: int = 0  # how many times torchrun restarted this group (TORCHELASTIC_RESTART_COUNT)

    @property
    def backend(self) -> str:
        return backend_for(self.device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, spec: DeviceSpec, env: Mapping[str, str] | None = None) -> Dist:
        """Read torchrun's variables once. Without them this is a world of one (`python script.py`)."""
        env = os.environ if env is None else env
        rank, world = int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1))
        local_rank, local_world = int(env.get("LOCAL_RANK", 0)), int(env.get("LOCAL_WORLD_SIZE", 1))
        if local_world > spec.count:
            raise ConfigError(f"{local_world} processes on this node but only {spec.count} device(s) in {spec}")
        return cls(rank, local_rank, world, local_world, spec.device(local_rank), "MASTER_ADDR" in env,
                   (env.get("MASTER_ADDR", ""), int(env.get("MASTER_PORT", 0))),
                   env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", int(env.get("TORCHELASTIC_RESTART_COUNT", 0)))

    def init(self, timeout_s: float) -> None:
        """Join the process group (torchrun's env:// rendezvous), with a timeout on every collective."""
        if td.is_initialized():
            return
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        td.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s), store=self._store(timeout_s),
                              rank=self.rank, world_size=self.world_size)

    def _store(self, timeout_s: float):
        """`python scripts/ddp.py` without torchrun: a world of one needs only an in-process store. Under
        the harness (store sharing off, loopback master): rank 0 hosts the workers' store on a socket bound
        to 127.0.0.1, since TCPStore would otherwise listen on every interface (harness/launch.py).
        Otherwise torchrun's env:// rendezvous, as usual."""
        if not self.launched:
            return td.HashStore()
        host, port = self.master
        if self.agent_store or host not in ("127.0.0.1", "localhost"):
            return None
        fd = None
        if self.rank == 0:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(("127.0.0.1", port))
            sock.listen()
            fd = sock.detach()  # the store serves on this fd; Python must not close it under the store
        return td.TCPStore("127.0.0.1", port, self.world_size, self.rank == 0, timedelta(seconds=timeout_s),
                           master_listen_fd=fd)

    @staticmethod
    def cleanup() -> None:
        # Explicit tear-down: process groups left to the interpreter's exit have aborted it (FIELD-NOTES).
        if td.is_initialized():
            td.destroy_process_group()

    def all_reduce_mean(self, t: torch.Tensor) -> torch.Tensor:
        """Mean over ranks (a no-op in a world of one): for printing losses, never for training."""
        if self.world_size == 1 or not td.is_initialized():
            return t
        t = t.to(self.device).clone()
        td.all_reduce(t)
        return (t / self.world_size).cpu()
