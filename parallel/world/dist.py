"""Distributed state: one small dataclass built once (from torchrun's environment, or given), passed
explicitly. Nothing else in the package reads os.environ for it. The backend follows the device here and
nowhere else: cuda -> nccl, cpu -> gloo."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as td

from parallel.world.devices import activate, gpu_count
from parallel.world.devicespec import DeviceSpec
from parallel.world.errors import ConfigError

# What the fork server imports once (fresh_processes): torch, dynamo (every optimizer imports it: 2-3 s), the
# collectives, ZeroRedundancyOptimizer's, DCP's and pipelining's modules (0.75 s a rank that uses them) and
# the package's entry points. A process forked from it starts in milliseconds, not 4-5 s.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed._functional_collectives",
           "torch.distributed.optim", "torch.distributed.checkpoint", "torch.distributed.pipelining",
           "parallel.worker", "parallel.judge.equivalence"]


def fresh_processes(shared_tensors: int = 0):
    """A multiprocessing context whose processes start fresh (no forked thread pool, lock or CUDA context)
    without importing torch again: they fork from multiprocessing's fork server, which has imported
    PRELOAD once and runs no tensor operation. A process gets the server's environment (the one of its
    first use) and the caller's sys.path. A shared tensor travels as a file descriptor, and a fork server
    takes fewer than 256 (ValueError: too many fds): for more than 200 `shared_tensors`, and where there
    is no fork server (not POSIX), each process is a new interpreter (spawn)."""
    import torch.multiprocessing as mp

    if "forkserver" not in mp.get_all_start_methods() or shared_tensors > 200:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read once, when the server starts (the first use in a process)
    return ctx


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def script_devices(text: str, launch: str, env: Mapping[str, str] | None = None) -> str:
    """What `--devices auto` means for a strategy's own script (scripts/<name>.py). A torchrun strategy's
    world is torchrun's: one device per process of this node, cuda:0..L-1 where there are GPUs, else
    cpu:L (L = --nproc_per_node; 1 for a plain `python scripts/ddp.py`, a world of one); on a machine with one
    GPU, cuda:0xL, the L ranks sharing it. The in-process
    strategies drive every device from one process, so for them `auto` keeps its usual meaning."""
    env = os.environ if env is None else env
    if text != "auto" or launch != "torchrun":
        return text
    local_world = int(env.get("LOCAL_WORLD_SIZE", 1))
    gpus = gpu_count()
    if not gpus:
        return f"cpu:{local_world}"
    if gpus == 1 and local_world > 1:  # one GPU: the ranks share it, over gloo (devicespec.py: cuda:0xK)
        return f"cuda:0x{local_world}"
    if gpus < local_world:
        raise ConfigError(f"{local_world} processes on this node but only {gpus} CUDA device(s) visible (one GPU "
                          f"is shared by all its ranks; several are not)")
    return "cuda:" + ",".join(map(str, range(local_world)))


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor, without importing torch.distributed.tensor: a tensor can be one only once
    it is imported, and importing it costs a process 0.7-0.8 s of start-up (python -X importtime), which
    most processes, never meeting a DTensor, need not pay."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank really holds of `t`: a DTensor's local shard (a DTensor's numel() is the global
    size), else the tensor itself."""
    return t.to_local() if is_dtensor(t) else t


_WATCH: dict[str, object] = {}  # the gloo group the watchdog's monitored barrier runs on, once made


def every_group_times_out(timeout_s: float) -> None:
    """Every group made from now on in this process waits at most `timeout_s` in a collective, as the world
    does. torch does not hand the world's timeout down: new_group(timeout=None), and so DeviceMesh's
    groups, FSDP2's and DTensor's, take `_get_default_timeout(backend)`, which reads this module's
    constants (30 minutes for gloo, 10 for nccl; torch 2.13 distributed_c10d.py, `_new_group_with_tag`
    and device_mesh.py's `_init_process_groups`). Setting them is the one switch that reaches every
    group a strategy or torch makes, without passing a timeout to each."""
    from torch.distributed import distributed_c10d as c10d

    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timedelta(seconds=timeout_s)


def watch_group(timeout_s: float):
    """The group of every rank that the training loop's watchdog meets in before each step
    (train._watchdog): the default group where it is gloo; under nccl, which has no monitored_barrier, a
    gloo group of the same ranks, made once here (every rank calls this right after joining: a collective).
    With it a rank that stops responding is named by the others ("Rank 1 failed to pass monitoredBarrier")
    on nccl too, rather than the NCCL watchdog aborting a healthy rank 0 over a collective that timed out."""
    if not td.is_initialized() or td.get_world_size() == 1:
        return None
    if td.get_backend() == "gloo":
        return td.GroupMember.WORLD
    if "group" not in _WATCH:
        _WATCH["group"] = td.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _WATCH["group"]


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
    shared: bool = False  # ranks share one GPU (cuda:0x2): gloo, since nccl refuses two ranks on a device

    @property
    def backend(self) -> str:
        return "gloo" if self.shared else backend_for(self.device)

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
                   env.get("TORCHELASTIC_USE_AGENT_STORE") == "True", int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
                   spec.shared)

    def init(self, timeout_s: float) -> None:
        """Join the process group (torchrun's env:// rendezvous), with a timeout on every collective."""
        if td.is_initialized():
            return
        activate([self.device])  # nccl binds the rank to the current device
        td.init_process_group(self.backend, timeout=timedelta(seconds=timeout_s), store=self._store(timeout_s),
                              rank=self.rank, world_size=self.world_size)
        every_group_times_out(timeout_s)
        watch_group(timeout_s)

    def _store(self, timeout_s: float):
        """The store the process group meets in.
        - `python scripts/ddp.py` without torchrun: a world of one needs only an in-process store.
        - Under the harness (store sharing off, loopback master): rank 0 hosts the workers' store on a
          socket bound to 127.0.0.1, since TCPStore would otherwise listen on every interface
          (launch/child.py).
        - Under a plain torchrun (the agent shares its store): the agent's store, with this attempt's own
          key prefix. The agent keeps one store for its whole life, and the process group's keys are the
          same in every attempt, so a restarted group would read the dead attempt's addresses (gloo:
          "connectFullMesh failed ... Connection refused"; nccl reads a stale unique id, pytorch#135712).
          torchrun's own fix is TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, but it is read by the agent, not
          here; launch.sh sets it, and this prefix makes a hand-typed torchrun recover too.
        - Otherwise (another node's store, store sharing off): torchrun's env:// rendezvous, as usual."""
        if not self.launched:
            return td.HashStore()
        host, port = self.master
        if self.agent_store:
            store = td.TCPStore(host, port, self.world_size, False, timedelta(seconds=timeout_s))
            return td.PrefixStore(f"parallel/attempt-{self.restart}/", store)
        if host not in ("127.0.0.1", "localhost"):
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
            td.destroy_process_group()  # every group, the watchdog's too
        _WATCH.clear()

    def all_reduce_mean(self, t: torch.Tensor, counts: bool = True) -> torch.Tensor:
        """Mean over the ranks that pass counts=True (a no-op in a world of one): for reporting losses,
        never for training. Every rank joins; the others add nothing."""
        if self.world_size == 1 or not td.is_initialized():
            return t
        weight = float(counts)
        both = torch.cat([t.reshape(-1) * weight, torch.tensor([weight])]).to(self.device)
        td.all_reduce(both)
        return (both[:-1] / both[-1]).reshape(t.shape).cpu()

    def any_rank(self, flag: bool) -> bool:
        """Whether any rank's `flag` is set, on every rank (a collective; itself in a world of one): for a
        decision each rank takes from what it alone holds, which must be the same on every rank, or the one
        that goes on leaves the others waiting in a collective it never issues (the clip's norm: a stage
        holding only a tied copy has no share of its own to reduce)."""
        if self.world_size == 1 or not td.is_initialized():
            return flag
        said = torch.tensor([float(flag)], device=self.device)
        td.all_reduce(said, op=td.ReduceOp.MAX)
        return bool(said.item())
