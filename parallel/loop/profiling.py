"""torch.profiler around the training loop: a short schedule, one trace per strategy per rank.

Traces go to <out>/tb/<strategy>/ named `<strategy>_rank<R>`, so ranks never overwrite each other
(torchtitan's habit), and TensorBoard's profiler plugin (torch-tb-profiler) opens them:
`tensorboard --logdir <out>/tb`. `merge` then writes <out>/timeline.json: every strategy's every rank in
one Chrome trace, each its own named track on one clock, which Perfetto (ui.perfetto.dev, or its trace
processor) and chrome://tracing open with no server. `write_scalars` puts each row's losses and step times
beside them, as TensorBoard scalars.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

from parallel.loop.results import Row, tb_run


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
_GPU = re.compile(r"^GPU (?P<index>\d+)$")  # Kineto's "process_labels" of a device's process
_PROCESS_META = ("process_name", "process_sort_index", "process_labels")
_IDS = ("id", "bind_id")  # flow ids (v1 "s"/"t"/"f" events, Perfetto's v2 "bind_id"); async and object ids too


def merge(tb: Path, out: Path) -> int:
    """Every <tb>/<strategy>/<strategy>_rank<R>.*.pt.trace.json in one Chrome trace at `out`, each file
    its own process track named "<strategy> rank <R>" (in run order). Each strategy starts at t = 0, so
    their steps line up one above the other instead of running end to end; the ranks of one strategy
    share one clock (each trace's times are microseconds after its baseTimeNanoseconds; one host's). Its host threads
    keep their tracks, and each GPU stream gets its own, "<strategy> rank <R> cuda:<D> stream <S>":
    Kineto writes each device as its own pid and each stream as a tid, so an in-process strategy's
    cuda:0 and cuda:1 both hold a "stream 7". Flow ids (the launch -> kernel and forward -> backward
    arrows) are correlation or sequence numbers that restart in every process: each file's are
    renumbered, so no arrow joins two ranks. Returns the number of tracks; writes nothing when there is
    no trace."""
    from parallel.loop.results import atomic_write

    files = sorted((int(m["stamp"]), m["strategy"], int(m["rank"]), f) for f in Path(tb).glob("*/*.pt.trace.json")
                   if (m := _TRACE.match(f.name)))
    if not files:
        return 0
    events, start, ids = [], {}, {}  # start: each strategy's first event
    for track, (_, strategy, rank, f) in enumerate(files, start=1):
        doc = json.loads(f.read_text())
        shift = doc.get("baseTimeNanoseconds", 0) / 1e3  # -> microseconds on the host's clock
        raw = doc.get("traceEvents", [])
        devices, streams = _streams(raw, f"{strategy} rank {rank}")
        events.append({"ph": "M", "name": "process_name", "pid": track, "tid": 0,
                       "args": {"name": f"{strategy} rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": track, "tid": 0, "args": {"sort_index": track}})
        for tid, label in streams.values():  # below the host threads, by device then stream
            events.append({"ph": "M", "name": "thread_name", "pid": track, "tid": tid, "args": {"name": label}})
            events.append({"ph": "M", "name": "thread_sort_index", "pid": track, "tid": tid,
                           "args": {"sort_index": tid}})
        for e in raw:
            if e.get("ph") == "M" and (e.get("name") in _PROCESS_META or e.get("pid") in devices):
                continue  # ours replace the profiler's ("python", its pid; "stream 7" on every device)
            stream = streams.get((e.get("pid"), e.get("tid")))
            e = {**e, "pid": track, "strategy": strategy, **({"tid": stream[0]} if stream else {})}
            if e.get("ph") != "M":
                for key in _IDS:
                    if isinstance(e.get(key), (int, str)):  # unique to this file, the same within it
                        e[key] = ids.setdefault((track, e[key]), len(ids) + 1)
            if "ts" in e:
                e["ts"] = float(e["ts"]) + shift
                if e.get("ph") != "M":
                    start[strategy] = min(start.get(strategy, e["ts"]), e["ts"])
            events.append(e)
    for e in events:  # each strategy's first event at 0
        strategy = e.pop("strategy", None)
        if "ts" in e:
            e["ts"] = round(e["ts"] - start.get(strategy, 0.0), 3)
    atomic_write(out, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return len(files)


def _streams(raw: list[dict], name: str) -> tuple[dict, dict]:
    """A Kineto trace's devices ({its pid: device index}, from the "GPU <D>" labels, or a kernel's or copy's
    args.device) and, for every (pid, tid) of a device that holds events, its track in the merged trace:
    (a tid above every host thread's, "<name> cuda:<D> <the profiler's name for it: stream <S>>")."""
    devices, host, names = {}, set(), {}
    for e in raw:
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        if e.get("ph") == "M" and e.get("name") == "process_labels":
            if m := _GPU.match(str(args.get("labels", ""))):
                devices[e.get("pid")] = int(m["index"])
            elif args.get("labels") == "CPU":
                host.add(e.get("pid"))
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            names[e.get("pid"), e.get("tid")] = str(args.get("name", "")).strip()
        elif isinstance(args.get("device"), int) and "stream" in args:
            devices.setdefault(e.get("pid"), args["device"])
    for pid in host:  # the host's own pid, should it equal a device index: its threads stay as they are
        devices.pop(pid, None)
    used = {(e.get("pid"), e.get("tid")) for e in raw if e.get("ph") != "M" and e.get("pid") in devices}
    first = 1 + max((t for e in raw if e.get("pid") not in devices and isinstance(t := e.get("tid"), int)), default=0)
    order = sorted(used, key=lambda k: (devices[k[0]], k[1] if isinstance(k[1], int) else -1, str(k[1])))
    return devices, {k: (first + i, f"{name} cuda:{devices[k[0]]} {names.get(k) or f'stream {k[1]}'}")
                     for i, k in enumerate(order)}


def write_scalars(tb: Path, row: Row) -> None:
    """Loss of every step and time of every timed step, as TensorBoard scalars in tb/<strategy>/ (beside
    its profiler traces, so one run in TensorBoard holds both)."""
    from torch.utils.tensorboard import SummaryWriter

    if not row.losses:
        return
    with SummaryWriter(str(tb / tb_run(row.strategy, row.variant))) as w:
        for step, loss in enumerate(row.losses):
            w.add_scalar("loss/train", loss, step)
        for name, values in row.loss_parts.items():  # the DCGAN's d_loss and g_loss
            for step, loss in enumerate(values):
                w.add_scalar(f"loss/{name}", loss, step)
        warm = len(row.losses) - len(row.step_ms) if len(row.step_ms) <= len(row.losses) else 0
        for i, ms in enumerate(row.step_ms):
            w.add_scalar("step_time_ms", ms, warm + i)
