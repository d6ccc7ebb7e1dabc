"""Checkpoint and resume through torch.distributed.checkpoint (DCP): every rank saves and loads its own
part, every K steps and at the end; a restarted (or re-run) job resumes from the last one.

    OUT/checkpoints/<strategy>/        .metadata + one __<rank>_0.distcp per rank that holds state

The state is the model's and the optimiser's, under the plain model's parameter names
(torch.distributed.checkpoint.state_dict.get_state_dict: DDP's `module.` prefix dropped; a DTensor or
FSDP2 shard saved as the shard), and the step. A world of one (the in-process strategies) writes the
same format without a process group. A checkpoint is written to a fresh folder beside the final one and
renamed into place once every rank has finished, so a reader never sees half a checkpoint.

The data of step s is a function of s alone (data.SyntheticData), so resuming at step s+1 with the
saved parameters and optimiser state continues exactly where the interrupted run was: the kill-and-
resume tests end bitwise equal to an uninterrupted run.

Loading is safe against a crafted checkpoint: DCP unpickles `.metadata` with plain pickle and the
non-tensor entries (the optimiser's hyper-parameters) with torch.load(weights_only=False), either of
which can run code. Here the metadata goes through an unpickler that admits only DCP's own metadata
classes, and the non-tensor entries through torch.load(weights_only=True).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import pickle
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed as td

from parallel.loop import optim
from parallel.world.errors import ConfigError

# torch.distributed.checkpoint is imported where it is used: it pulls in DTensor, about 0.5 s of start-up
# (python -X importtime) for every process of every run, most of which never checkpoint.


def path(config, strategy_name: str) -> Path:
    return Path(config.out) / "checkpoints" / strategy_name


def _plain(model):
    return getattr(model, "module", model)  # DDP and DataParallel wrap the model


def _optimizers(optimizer) -> list:
    return list(optimizer.optimizers.values()) if hasattr(optimizer, "optimizers") else [optimizer]


def state(trainable) -> dict:
    """What a checkpoint holds, as DCP wants it: the model's and optimisers' state by parameter name, and
    the step. (A strategy whose optimiser does not hold the model's parameters brings its own, the
    `checkpoint_state` and `restore_checkpoint` hooks: zero's slices.)"""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(_plain(trainable.model), _optimizers(trainable.optimizer))
    return {"model": model_sd, "optim": optim_sd, "step": torch.zeros((), dtype=torch.int64)}


def per_rank(trainable, split, world: int) -> dict:
    """A `checkpoint_state` for ranks that hold different plain tensors under the same names (manual_tp's
    shards): the live parameters and SGD's momentum, each `split(name)` one under a key of this rank's own
    (`@tp1of2`). DCP writes a plain tensor that every rank names alike once, as replicated: under the plain
    names every rank resumed from rank 0's shards, a resume that trained another model (found in #45). It
    resumes on the same world; `base.loaded_in_place` restores it (DCP loads into the live tensors)."""
    rank = td.get_rank() if td.is_initialized() else 0
    out, params = {"step": torch.zeros((), dtype=torch.int64)}, dict(trainable.model.named_parameters())
    for name, value in trainable.model.state_dict().items():
        key = f"{name}@tp{rank}of{world}" if split(name) else name
        out[f"model.{key}"] = value
        if name in params:  # the optimiser makes its state at the first step: made now, as zeros, to load into
            out |= {f"{k}.{key}": v for k, v in optim.state_now(trainable.optimizer, params[name]).items()}
    return out


def restore(trainable, sd: dict) -> None:
    """Put a loaded `state` back into the model and optimisers."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(_plain(trainable.model), _optimizers(trainable.optimizer),
                   model_state_dict=sd["model"], optim_state_dict=sd["optim"])


def save(config, strategy, trainable, step: int, dist) -> None:
    """Every rank writes its part into a fresh folder; once all have (a barrier), rank 0 swaps it in."""
    final = path(config, strategy.name)
    tmp = final.with_name(f".{final.name}.step{step}")
    if dist.is_main:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
    _barrier()
    sd = strategy.checkpoint_state(trainable)
    sd["step"].fill_(step)
    import torch.distributed.checkpoint as dcp

    with _single_process_is_meant():
        dcp.save(sd, checkpoint_id=tmp, no_dist=not td.is_initialized())  # ends gathering every rank's writes
    if dist.is_main:
        old = final.with_name(f".{final.name}.old")
        if final.exists():
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    _barrier()


@contextlib.contextmanager
def _single_process_is_meant():
    """DCP warns on every save and load without a process group, even when told no_dist=True: a world of
    one (the in-process strategies) is what is meant here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        yield


def _barrier() -> None:
    if td.is_initialized():
        td.barrier()


def resume_point(config, strategy, trainable) -> int:
    """Restore the checkpoint this run should continue from, if any; return the first step to run."""
    folder = Path(config.resume_from) if config.resume_from else path(config, strategy.name)
    if not (config.resume_from or (config.resume and (folder / ".metadata").exists())):
        return 0
    sd = strategy.checkpoint_state(trainable)
    load_into(folder, sd)
    try:
        strategy.restore_checkpoint(trainable, sd)
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {str(folder)!r} does not fit this model: {str(e).splitlines()[0]}") from None
    return int(sd["step"]) + 1


def check_fits(folder: Path, model, what: str) -> None:
    """ConfigError unless `folder` holds a checkpoint whose parameters fit `model` (names and shapes)."""
    try:
        load_into(folder, {"model": model.state_dict()})
    except ConfigError as e:
        raise ConfigError(str(e).replace("does not fit this model", f"does not fit {what}")) from None


def load_into(folder: Path, sd: dict) -> None:
    """Fill `sd` (tensors in place, other entries replaced) from the checkpoint in `folder`; ConfigError,
    one line, for a folder that is missing, not a checkpoint, unreadable, or for another model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = _safe_loading()
    if not (folder / ".metadata").is_file():
        what = "does not exist" if not folder.exists() else "is not a checkpoint of this program (no .metadata)"
        raise ConfigError(f"checkpoint {str(folder)!r} {what}")
    try:  # first on its own: what is not DCP's metadata, or would run code, is refused before DCP reads it
        reader(folder).read_metadata()
    except Exception as e:  # noqa: BLE001 - a corrupt file raises many kinds
        raise ConfigError(f"checkpoint {str(folder)!r} cannot be read: {type(e).__name__}: {e}") from None
    try:
        with _single_process_is_meant():
            dcp.load(sd, storage_reader=reader(folder), planner=planner(), no_dist=not td.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps a rank's failure in its own
        cause = _first_line(e)
        what = "does not fit this model" if "Missing key" in cause or "size" in cause else "cannot be read"
        raise ConfigError(f"checkpoint {str(folder)!r} {what}: {cause}") from None


def _first_line(e: BaseException) -> str:
    """The line of a (DCP-wrapped) failure that says what went wrong, e.g. "Missing key in checkpoint
    state_dict: model.fc1.weight."."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith(("RuntimeError", "ValueError", "KeyError", "AssertionError"))]
    return (said[-1] if said else lines[-1] if lines else type(e).__name__)[:300]


# ---- loading a checkpoint that runs no code


_METADATA_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("torch", "Size"),
                     ("torch.serialization", "_get_layout"),
                     ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's metadata classes, torch's dtypes and sizes, paths: nothing that can run code."""

    def find_class(self, module: str, name: str):
        if (module, name) in _METADATA_GLOBALS or module == "torch.distributed.checkpoint.metadata" or \
                (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")


@functools.cache
def _safe_loading() -> tuple[type, type]:
    """DCP's file reader and load planner, made safe: the metadata through _MetadataUnpickler, the
    non-tensor entries (the optimiser's lr, momentum, ...) through torch.load(weights_only=True)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            rank = kwargs.get("rank")
            with open(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"), "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return SafeReader, SafePlanner


def atomic_save(file: Path, obj) -> None:
    """torch.save to a temporary file beside `file`, then rename: a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name}.", dir=file.parent)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
