"""`profiling.merge` on synthetic Kineto traces with GPU activity, which this CPU-only suite cannot record.

The files mimic what torch.profiler (Kineto) writes with ProfilerActivity.CUDA, as read from a real trace
(torch 2.11, H200) and the format strings in libtorch (2.13). The fields merge relies on:
- top level: "traceEvents" and "baseTimeNanoseconds" (times are microseconds after it);
- the host process: pid = the OS pid, labelled by "process_labels" {"labels": "CPU"}; tid = the OS thread id;
- each GPU: its own pid (the device index), labelled "process_labels" {"labels": "GPU <index>"} (Kineto lists
  every visible device, used or not), tid = the CUDA stream, named by a "thread_name" metadata event
  "stream <id> "; kernels ("cat": "kernel") and copies ("gpu_memcpy") also carry args.device/stream;
- a launch (cat "cuda_runtime" on the host thread) and its kernel share args.correlation, and Kineto joins
  them with a flow: {"ph": "s", "cat": "ac2g", "id": correlation} at the launch's ts and tid, and
  {"ph": "f", "bp": "e", ...} at the kernel's. Correlation ids restart in every process: every rank's
  file holds the same ids. (fwdbwd flows link forward to backward ops the same way.)
"""

import json

from parallel.loop.profiling import merge
from tests.test_cli import assert_one_timeline

BASE_NS = 1_790_000_000_000_000_000


def kineto_trace(os_pid: int, devices: list[int], t0: float) -> dict:
    """One rank's trace: one host thread launching one kernel on the default stream (7) of each device, the
    launches' correlation ids the same in every file (100, 101, ...)."""
    tid, events = os_pid, []
    events += [{"ph": "M", "name": "process_name", "ts": t0, "pid": os_pid, "tid": 0, "args": {"name": "python"}},
               {"ph": "M", "name": "process_labels", "ts": t0, "pid": os_pid, "tid": 0, "args": {"labels": "CPU"}},
               {"ph": "M", "name": "thread_name", "ts": t0, "pid": os_pid, "tid": tid,
                "args": {"name": f"thread {tid} (python)"}}]
    for d in range(8):  # Kineto names every visible GPU, used or not
        events += [{"ph": "M", "name": "process_name", "ts": t0, "pid": d, "tid": 0, "args": {"name": "python"}},
                   {"ph": "M", "name": "process_labels", "ts": t0, "pid": d, "tid": 0, "args": {"labels": f"GPU {d}"}},
                   {"ph": "M", "name": "process_sort_index", "ts": t0, "pid": d, "tid": 0,
                    "args": {"sort_index": 5000000 + d}}]
    events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": os_pid, "tid": tid, "ts": t0, "dur": 50.0,
                   "args": {"External id": 1}})
    for i, d in enumerate(devices):
        corr, launch, start = 100 + i, t0 + 10.0 * i, t0 + 100.0 + 10.0 * i
        gpu = {"device": d, "context": 1, "stream": 7, "correlation": corr}
        events += [
            {"ph": "M", "name": "thread_name", "ts": t0, "pid": d, "tid": 7, "args": {"name": "stream 7 "}},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": os_pid, "tid": tid, "ts": launch,
             "dur": 5.0, "args": {"cbid": 211, "correlation": corr}},
            {"ph": "s", "id": corr, "pid": os_pid, "tid": tid, "ts": launch, "cat": "ac2g", "name": "ac2g"},
            {"ph": "X", "cat": "kernel", "name": f"gemm on {d}", "pid": d, "tid": 7, "ts": start, "dur": 4.0,
             "args": gpu},
            {"ph": "f", "id": corr, "pid": d, "tid": 7, "ts": start, "cat": "ac2g", "name": "ac2g", "bp": "e"},
        ]
    return {"schemaVersion": 1, "baseTimeNanoseconds": BASE_NS, "traceEvents": events}


def write(tb, strategy: str, rank: int, stamp: int, doc: dict) -> None:
    (tb / strategy).mkdir(parents=True, exist_ok=True)
    (tb / strategy / f"{strategy}_rank{rank}.{stamp}.pt.trace.json").write_text(json.dumps(doc))


def merged(tmp_path) -> dict:
    """manual_dp: one process driving cuda:0 and cuda:1; ddp: two ranks, one GPU each, pids 0 and 1 in their
    own files too. All three files use the same correlation ids."""
    tb = tmp_path / "tb"
    write(tb, "manual_dp", 0, 1, kineto_trace(4242, [0, 1], 1000.0))
    write(tb, "ddp", 0, 2, kineto_trace(5000, [0], 2000.0))
    write(tb, "ddp", 1, 3, kineto_trace(5001, [1], 2000.5))
    assert merge(tb, tmp_path / "timeline.json") == 3
    return assert_one_timeline(tmp_path / "timeline.json", {"manual_dp rank 0", "ddp rank 0", "ddp rank 1"})


def test_each_device_stream_of_each_rank_is_its_own_named_track(tmp_path):
    doc = merged(tmp_path)
    events, processes = doc["events"], doc["names"]
    threads = {}
    for e in events:
        if e.get("ph") == "M" and e["name"] == "thread_name":
            assert (e["pid"], e["tid"]) not in threads, f"two names for one track: {e}"
            threads[e["pid"], e["tid"]] = e["args"]["name"]
    kernels = {e["name"]: (processes[e["pid"]], threads.get((e["pid"], e["tid"])), e["pid"], e["tid"])
               for e in events if e.get("cat") == "kernel" and processes[e["pid"]] == "manual_dp rank 0"}
    assert kernels["gemm on 0"][:2] == ("manual_dp rank 0", "manual_dp rank 0 cuda:0 stream 7")
    assert kernels["gemm on 1"][:2] == ("manual_dp rank 0", "manual_dp rank 0 cuda:1 stream 7")
    tracks = {k[2:] for k in kernels.values()}
    cpu = {(e["pid"], e["tid"]) for e in events if e.get("cat") == "cpu_op"}
    assert len(tracks) == 2 and not tracks & cpu  # neither on the other device's track nor on a host thread's
    gpu_names = sorted(n for n in threads.values() if "cuda:" in n)
    assert gpu_names == ["ddp rank 0 cuda:0 stream 7", "ddp rank 1 cuda:1 stream 7",
                         "manual_dp rank 0 cuda:0 stream 7", "manual_dp rank 0 cuda:1 stream 7"]
    # every kernel sits on a named track; the host threads keep the profiler's names
    assert all((e["pid"], e["tid"]) in threads for e in events if e.get("ph") == "X" and e.get("cat") != "Trace")
    assert "thread 4242 (python)" in threads.values()


def test_flow_arrows_join_each_launch_to_its_own_kernel_never_another_ranks(tmp_path):
    events = merged(tmp_path)["events"]
    at = {(e["pid"], e["tid"], e["ts"]): e for e in events if e.get("ph") == "X"}
    flows = {}
    for e in events:
        if e.get("ph") in ("s", "f"):
            assert (e["cat"], e["name"], e["id"], e["ph"]) not in flows, f"a flow id used twice: {e}"
            flows[e["cat"], e["name"], e["id"], e["ph"]] = e
    starts = {k[:3]: e for k, e in flows.items() if k[3] == "s"}
    assert len(starts) == 4 and len(flows) == 8  # 4 launches (2 + 1 + 1), each with its own id
    for key, s in starts.items():
        f = flows[(*key, "f")]
        launch, kernel = at[s["pid"], s["tid"], s["ts"]], at[f["pid"], f["tid"], f["ts"]]
        assert launch["name"] == "cudaLaunchKernel" and kernel["cat"] == "kernel"
        assert s["pid"] == f["pid"] and launch["args"]["correlation"] == kernel["args"]["correlation"]


def test_each_strategy_starts_at_zero_and_its_ranks_keep_one_clock(tmp_path):
    """Strategies ran one after another (manual_dp at 1000 us, ddp at 2000 us): the timeline lines their
    steps up from t = 0 instead of end to end; ddp's rank 1 keeps its 0.5 us offset from rank 0."""
    doc = merged(tmp_path)
    first: dict[str, float] = {}
    for e in doc["events"]:
        if e.get("ph") == "X":
            name = doc["names"][e["pid"]]
            first[name] = min(first.get(name, e["ts"]), e["ts"])
    assert first == {"manual_dp rank 0": 0.0, "ddp rank 0": 0.0, "ddp rank 1": 0.5}
