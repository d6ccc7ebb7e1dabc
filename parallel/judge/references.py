"""`single`'s runs on disk, for the oracle's batch runs (judge/mutants.py): one file a run, loaded by the
one process that judges, one at a time."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

import torch

from parallel.judge import equivalence
from parallel.loop.results import Rule


class References:
    """`single`'s runs, one file each in a folder, loaded by the one process that judges, one at a time
    (the jobs come grouped by run): an fp64 MLP's reference is 60 MB, and a hundred of them in every rank
    of a group ran a 24 GB machine out of memory."""

    def __init__(self, folder: str):
        self.folder, self.last = Path(folder), ("", None)

    def _path(self, key: str) -> Path:
        return self.folder / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.pt"

    def put(self, key: str, ref: equivalence.Reference) -> None:
        noise = dataclasses.asdict(ref.noise) if ref.noise else None
        torch.save({"initial": ref.initial, "state": ref.state, "losses": ref.losses, "noise": noise,
                    "causes": ref.causes}, self._path(key))

    def get(self, key: str) -> equivalence.Reference:
        if self.last[0] != key:
            d = torch.load(self._path(key), weights_only=True)
            self.last = (key, equivalence.Reference(d["initial"], d["state"], d["losses"],
                                                    Rule(**d["noise"]) if d["noise"] else None, d["causes"]))
        return self.last[1]
