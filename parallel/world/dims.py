"""How a run's processes are laid out: data parallel (replicate x shard), context, tensor, pipeline parallel.

Built once per run from the strategy's declaration and passed explicitly (torchtitan's ParallelDims).
Ranks are numbered with tensor parallel innermost, then context parallel, the data-parallel shard and
replicate axes, then pipeline stages
outermost, the order of torchtitan's mesh ["pp", "dp_replicate", "dp_shard", "cp", "tp"]:

    pp 1 x dp 2 x tp 2 on 4 processes:   rank 0: dp 0 tp 0   rank 1: dp 0 tp 1
                                         rank 2: dp 1 tp 0   rank 3: dp 1 tp 1

so the ranks of one tensor-parallel group are neighbours (on GPUs: the same node, the fastest links).
What each coordinate means for the data: a rank trains on its dp coordinate's share of the global batch;
every tp rank of a group sees the same share, and so does every cp rank (each keeps its slice of the
sequences); pipeline stages share one dp coordinate too (the first stage reads the inputs, the last the
targets).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from parallel.world.errors import ConfigError

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")  # outermost first


@dataclass(frozen=True)
class ParallelDims:
    world: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: each rank of a group holds a slice of every sequence of the dp share
    loss_pp: int = -1  # the pipeline coordinate whose rank computes the loss: -1, the last; 0 when the last
    #   stage sits on the first rank (a V placement: rank r holds stages r and 2 pp - 1 - r)

    def __post_init__(self):
        for f in fields(self):
            if f.name != "loss_pp" and getattr(self, f.name) < 1:
                raise ConfigError(f"{f.name} must be at least 1, got {getattr(self, f.name)}")
        if self.dp * self.cp * self.tp * self.pp != self.world:
            dp = f"dp {self.dp}" if self.dp_replicate == 1 or self.dp_shard == 1 else \
                f"dp {self.dp_replicate} (replicate) x {self.dp_shard} (shard)"
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ConfigError(f"{dp}{cp} x tp {self.tp} x pp {self.pp} = {self.dp * self.cp * self.tp * self.pp}, "
                              f"but {self.world} processes")

    @classmethod
    def data_parallel(cls, world: int) -> ParallelDims:
        """Every process a replica with its own share of the batch (DDP, manual_ddp; a world of one)."""
        return cls(world=world, dp_replicate=world)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def coords(self, rank: int) -> dict[str, int]:
        """{"pp": .., "dp_replicate": .., "dp_shard": .., "tp": ..} of `rank`."""
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} is not in a world of {self.world}")
        out = {}
        for name in reversed(ORDER):  # innermost first
            size = getattr(self, name)
            out[name], rank = rank % size, rank // size
        return {name: out[name] for name in ORDER}

    def dp_rank(self, rank: int) -> int:
        """The data-parallel coordinate: which share of the global batch `rank` trains on."""
        c = self.coords(rank)
        return c["dp_replicate"] * self.dp_shard + c["dp_shard"]

    def batch_share(self, rank: int) -> tuple[int, int]:
        """(index, count) of `rank`'s share of the global batch: its dp coordinate's."""
        return self.dp_rank(rank), self.dp

    def counts_loss(self, rank: int) -> bool:
        """Whether `rank`'s loss is part of the step's loss: one tp rank per group (they all hold the same
        loss) and the rank of the last pipeline stage (the only one that computes it). Every cp rank's
        counts: each holds the mean over its own, equal slice of the sequences."""
        c = self.coords(rank)
        return c["tp"] == 0 and c["pp"] == self.loss_pp % self.pp

    def mesh(self, device_type: str, keep: tuple[str, ...] = ()):
        """torch's DeviceMesh over the dimensions larger than one and those named in `keep` whatever their
        size (a composition that slices them: fsdp_cp's dp_shard on 2 ranks); every rank joins: a collective.
        Made once per run; each dimension applied to the model gets its slice, mesh["tp"] (torchtitan's way).
        Given explicitly, on "cpu" for gloo: without it FSDP2 picks the accelerator on a GPU host and a
        gloo run crashes (pytorch#132471)."""
        from torch.distributed.device_mesh import init_device_mesh  # torch.distributed's heavy part, on use

        names = tuple(n for n in ORDER if getattr(self, n) > 1 or n in keep) or ("dp_replicate",)
        return init_device_mesh(device_type, tuple(getattr(self, n) for n in names), mesh_dim_names=names)

    def __str__(self) -> str:
        return " x ".join(f"{n} {getattr(self, n)}" for n in ORDER if getattr(self, n) > 1) or "one process"
