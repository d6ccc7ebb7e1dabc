"""The `--devices` grammar: DeviceSpec, the device list a run trains on, parsed from its text.

    auto         every visible CUDA device (one GPU: cuda:0x2, shared), else cpu:2
    cpu:N        N virtual devices on this CPU; the cores are split between them
    cuda:0,1,..  real GPUs (indices into what CUDA_VISIBLE_DEVICES leaves visible)
    cuda:IxK     K ranks (or replicas) sharing the one GPU I, the way cpu:K shares the CPU: every CUDA path
                 runs on a real GPU, the parallel speed does not. nccl refuses two ranks on one GPU (NCCL
                 2.28.9: "invalid usage" at init, measured on an H200), so these ranks talk over gloo,
                 which takes CUDA tensors in its collectives but not in send/recv (devices.SHARED_GLOO_NO_P2P).

No CUDA call here: how many GPUs are visible is devices.gpu_count()'s answer, why they cannot be used
machine.unusable_gpus()'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.world import devices, machine
from parallel.world.errors import ConfigError


@dataclass(frozen=True)
class DeviceSpec:
    kind: str  # "cpu" | "cuda"
    ids: tuple[int, ...]  # CUDA indices; for cpu, 0..N-1 names the virtual devices

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def real(self) -> bool:
        """Runs on GPUs (shared or not), as opposed to virtual devices on the CPU."""
        return self.kind == "cuda"

    @property
    def shared(self) -> bool:
        """Several ranks on one GPU (cuda:0x2): real devices, but not parallel ones."""
        return self.real and len(set(self.ids)) < len(self.ids)

    @property
    def kind_label(self) -> str:
        """What the devices are, for rows and notes: real GPUs, one GPU shared, or virtual CPU devices."""
        return "shared" if self.shared else "real" if self.real else "virtual"

    @property
    def backend(self) -> str:
        """The process group's backend: nccl on GPUs of their own, gloo on the CPU and on a shared GPU."""
        return "nccl" if self.real and not self.shared else "gloo"

    def device(self, i: int) -> torch.device:
        """The torch device that the i-th device of the list runs on."""
        return torch.device("cuda", self.ids[i]) if self.real else torch.device("cpu")

    def first(self, n: int) -> DeviceSpec:
        """n devices of the same kind, taken from this list: its first n GPUs (the user's own, cuda:4,5,...),
        n ranks on the shared GPU, or n virtual CPU devices (any n: they are made, not found)."""
        if self.kind == "cpu":
            return DeviceSpec("cpu", tuple(range(n)))
        if self.shared:
            return DeviceSpec("cuda", (self.ids[0],) * n)
        if n > self.count:
            raise ConfigError(f"{n} devices asked of {self}, which has {self.count} (to share a GPU: "
                              f"cuda:{self.ids[0]}x{n})")
        return DeviceSpec("cuda", self.ids[:n])

    def threads_per_device(self) -> int:
        """CPU threads each device (thread or process) may use: the cores split, never oversubscribed
        (at least one, so cpu:3 on two cores does oversubscribe, and machine.environment() says so)."""
        return max(1, devices.cpu_cores() // self.count)

    def __str__(self) -> str:
        if self.shared:
            return f"cuda:{self.ids[0]}x{self.count}"
        if self.real:
            return "cuda:" + ",".join(map(str, self.ids))
        return f"cpu:{self.count}"


SHARE_DEFAULT = 2  # ranks sharing the GPU when `auto` finds exactly one


def parse_devices(text: str) -> DeviceSpec:
    """Parse `auto`, `cpu:N` or `cuda:i,j,...` against the hardware that is here."""
    text = text.strip()
    if text == "auto":
        n = devices.gpu_count()
        if n == 1:  # one GPU: every CUDA path still runs, on ranks that share it (the row says so)
            return DeviceSpec("cuda", (0,) * SHARE_DEFAULT)
        return DeviceSpec("cuda", tuple(range(n))) if n else DeviceSpec("cpu", (0, 1))
    kind, sep, rest = text.partition(":")
    if kind == "cpu":
        if sep and not rest.isdigit():
            raise ConfigError(f"--devices {text!r}: cpu takes a count of virtual devices, e.g. cpu:2")
        n = int(rest) if sep else 1
        if not 1 <= n <= 64:
            raise ConfigError(f"--devices {text!r}: the virtual device count must be 1..64, got {n}")
        return DeviceSpec("cpu", tuple(range(n)))
    if kind == "cuda":
        parts = rest.split(",") if sep and rest else []
        index, x, share = rest.partition("x")
        if x and index.isdigit() and share.isdigit():  # cuda:IxK, one GPU shared by K ranks
            if not 1 <= int(share) <= 16:
                raise ConfigError(f"--devices {text!r}: ranks sharing one GPU must be 1..16, got {share}")
            parts = [index] * int(share)
        elif not parts or not all(p.isdigit() for p in parts):
            raise ConfigError(f"--devices {text!r}: expected cuda:0, cuda:0,1,... or cuda:0x2 (2 ranks sharing "
                              "GPU 0)")
        ids = tuple(int(p) for p in parts)
        if len(set(ids)) != len(ids) and not x:
            raise ConfigError(f"--devices {text!r}: a device is listed twice (to share one GPU between ranks, "
                              f"cuda:{ids[0]}x2)")
        visible = devices.gpu_count()
        if visible == 0:
            why = machine.unusable_gpus() or f"CUDA is not available here (torch {torch.__version__}, no NVIDIA GPU)"
            raise ConfigError(f"--devices {text!r}: {why}")
        if max(ids) >= visible:
            raise ConfigError(f"--devices {text!r}: only {visible} CUDA device(s) are visible")
        return DeviceSpec("cuda", ids)
    raise ConfigError(f"--devices {text!r}: expected auto, cpu:N, cuda:0,1,... or cuda:IxK")
