"""Checkpoint and resume: rank 0 saves the model and optimiser every K steps and at the end, atomically,
then every rank waits at a barrier; a restarted (or re-run) job resumes from the last one.

The data of step s is a function of s alone (workloads.SyntheticData), so resuming at step s+1 with the
saved parameters and optimiser state continues exactly where the interrupted run was: the kill-and-
resume test ends with the same parameters as an uninterrupted run. Loading uses weights_only=True, so a
checkpoint cannot run code.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as td

from parallel.errors import ConfigError


def path(config, strategy_name: str) -> Path:
    return Path(config.out) / "checkpoints" / f"{strategy_name}.pt"


def load(file: Path) -> dict:
    """The checkpoint at `file`, checked; ConfigError (one line, exit 2) if it is missing or not one."""
    try:
        ckpt = torch.load(file, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ConfigError(f"checkpoint {str(file)!r} does not exist") from None
    except Exception as e:  # noqa: BLE001 - torch raises many kinds for a corrupt file
        raise ConfigError(f"checkpoint {str(file)!r} cannot be read: {type(e).__name__}") from None
    if not (isinstance(ckpt, dict) and {"step", "model", "optimizer"} <= ckpt.keys()):
        raise ConfigError(f"checkpoint {str(file)!r} is not a checkpoint of this program")
    return ckpt


def resume_point(config, strategy, trainable) -> int:
    """Restore the checkpoint this run should continue from, if any; return the first step to run."""
    file = Path(config.resume_from) if config.resume_from else path(config, strategy.name)
    if not (config.resume_from or (config.resume and file.exists())):
        return 0
    ckpt = load(file)
    model = getattr(trainable.model, "module", trainable.model)  # DDP and DataParallel wrap the model
    try:
        model.load_state_dict(ckpt["model"])
        trainable.optimizer.load_state_dict(ckpt["optimizer"])
    except (RuntimeError, ValueError, KeyError) as e:
        raise ConfigError(f"checkpoint {str(file)!r} does not fit this model: {str(e).splitlines()[0]}") from None
    return ckpt["step"] + 1


def save(config, strategy, trainable, step: int, dist) -> None:
    """Rank 0 writes (to a temporary file, then renames); every rank waits until it is written."""
    if dist.is_main:
        file = path(config, strategy.name)
        file.parent.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "model": strategy.state_dict(trainable), "optimizer": trainable.optimizer.state_dict()}
        atomic_save(file, state)
    if td.is_initialized():
        td.barrier()


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
