"""torch.profiler around the training loop: a short schedule, one trace per strategy per rank.

Traces go to <out>/tb/<strategy>/ named `<strategy>_rank<R>`, so ranks never overwrite each other
(torchtitan's habit), and TensorBoard's profiler plugin (torch-tb-profiler) opens them:
`tensorboard --logdir <out>/tb`. `merge` then writes <out>/timeline.json: every strategy's every rank in
one Chrome trace, each its own named track on one clock, which Perfetto (ui.perfetto.dev, or its trace
processor) and chrome://tracing open with no server.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


class _Off(contextlib.nullcontext):
    def step(self) -> None:
        pass


def make_profiler(enabled: bool, out: str, strategy: str, rank: int, device: torch.device):
    """A profiler with `.step()`, or a stand-in that does nothing when profiling is off."""
    if not enabled:
        return _Off()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_dir = Path(out) / "tb" / strategy
    trace_dir.mkdir(parents=True, exist_ok=True)
    return profile(
        activities=activities,
        # skip one step (start-up effects), warm the profiler up for one, record three: small traces.
        schedule=schedule(wait=1, warmup=1, active=3, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(trace_dir), worker_name=f"{strategy}_rank{rank}"),
        profile_memory=True,
        record_shapes=False,
        experimental_config=_all_threads(),  # the in-process strategies' device threads too, not only this one
    )


def _all_threads():
    """Kineto's profile_all_threads (torch 2.13; an experimental config, so absent on older torch: None)."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(profile_all_threads=True)
    except (ImportError, TypeError):
        return None


def name_this_thread(name: str) -> None:
    """Give the calling thread an OS-level name (Linux: its /proc comm, at most 15 bytes), which the
    profiler writes as its track's name: the in-process strategies' device threads show as
    "device cpu:0", not "python". Elsewhere the track keeps its number."""
    try:
        Path(f"/proc/self/task/{threading.get_native_id()}/comm").write_text(name[:15])
    except OSError:
        pass


_TRACE = re.compile(r"^(?P<strategy>.+)_rank(?P<rank>\d+)\.(?P<stamp>\d+)\.pt\.trace\.json$")


def merge(tb: Path, out: Path) -> int:
    """Every <tb>/<strategy>/<strategy>_rank<R>.*.pt.trace.json in one Chrome trace at `out`, each file
    its own process track named "<strategy> rank <R>" (in run order), every time on one clock (each
    trace's times are microseconds after its baseTimeNanoseconds; one host's clock). Returns the number
    of tracks; writes nothing when there is no trace."""
    from parallel.results import atomic_write

    files = sorted((int(m["stamp"]), m["strategy"], int(m["rank"]), f) for f in Path(tb).glob("*/*.pt.trace.json")
                   if (m := _TRACE.match(f.name)))
    if not files:
        return 0
    events, start = [], None
    for track, (_, strategy, rank, f) in enumerate(files, start=1):
        doc = json.loads(f.read_text())
        shift = doc.get("baseTimeNanoseconds", 0) / 1e3  # -> microseconds on the host's clock
        events.append({"ph": "M", "name": "process_name", "pid": track, "tid": 0,
                       "args": {"name": f"{strategy} rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": track, "tid": 0, "args": {"sort_index": track}})
        for e in doc.get("traceEvents", []):
            if e.get("ph") == "M" and e.get("name") in ("process_name", "process_sort_index", "process_labels"):
                continue  # ours replace the profiler's ("python", its pid)
            e = {**e, "pid": track}
            if "ts" in e:
                e["ts"] = float(e["ts"]) + shift
                if e.get("ph") != "M":
                    start = e["ts"] if start is None else min(start, e["ts"])
            events.append(e)
    for e in events:  # the first event of the run at 0
        if "ts" in e:
            e["ts"] = round(e["ts"] - (start or 0.0), 3)
    atomic_write(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(files)
