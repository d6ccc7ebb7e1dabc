"""GPU basics (parallel/basics/): correct timing, streams, device memory, memory savers. The CUDA halves
carry their own skip marker; everything else runs here, on CPU."""

import json
from types import SimpleNamespace

import pytest
import torch

from parallel import cli
from parallel.basics import bench, implausible, memory, savers, streams

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MiB = 2**20


def test_synchronized_timing_of_a_slow_async_step_is_not_faster_than_the_step():
    device = bench.AsyncDevice()  # work runs on a background thread, like a GPU's queue
    step_s = 0.05
    synced = bench.time_synced(lambda: device.launch(step_s), device.synchronize, repeats=4, warmup=1)
    naive = bench.time_naive(lambda: device.launch(step_s), device.synchronize, repeats=4, warmup=1)
    assert synced["min_ms"] >= step_s * 1e3  # every synchronized measurement includes the whole step
    assert naive["p50_ms"] < 0.1 * step_s * 1e3  # the pitfall: without a sync the clock sees only the queueing


def test_cpu_vs_gpu_bench_runs_the_cpu_side_and_says_the_gpu_side_was_not_run(tmp_path, capsys):
    assert cli.main(["bench", "cpu-vs-gpu", "--scale", "0.002", "--repeats", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads((tmp_path / "bench-cpu-vs-gpu.json").read_text())
    cases = {(line["case"].split(" ")[0], line["device"]) for line in doc["lines"]}
    assert {("sum", "cpu"), ("matrix", "cpu"), ("train", "cpu"), ("matrix", "numpy (cpu)")} <= cases
    sim = next(line for line in doc["lines"] if line["device"] == "simulated")
    assert sim["synced"]["p50_ms"] >= 20 > sim["naive"]["p50_ms"]
    if not torch.cuda.is_available():
        assert "GPU side not run" in out and not any(line["device"].startswith("cuda") for line in doc["lines"])


@pytest.mark.parametrize("argv, message", [
    (["bench", "cpu-vs-gpu", "--repeats", "0"], "--repeats must be at least 1"),
    (["bench", "memory", "--workload", "dcgan"], "mlp, cnn or transformer"),
    (["bench", "memory", "--budget-mb", "-1"], "--budget-mb 0 or more"),
])
def test_bench_refuses_bad_input(argv, message, refused):
    refused(argv, message)


def test_streams_say_they_do_not_apply_on_cpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: test_stream_fixes_always_give_the_right_sum runs instead")
    assert cli.main(["bench", "streams"]) == 0
    assert "streams do not apply on CPU" in capsys.readouterr().out


@cuda
def test_stream_fixes_always_give_the_right_sum():
    counts = streams.check(torch.device("cuda", 0), trials=20)
    right = [name for name in counts if name.startswith("right")]
    assert len(right) == 2 and all(counts[name] == 20 for name in right), counts
    # The race itself depends on the GPU's scheduling: not asserted, only reported.


def test_freeing_a_large_cpu_tensor_gives_its_memory_back():
    stages = dict(memory.empty_cache_demo(torch.device("cpu"), mib=256))
    start, allocated, freed = (stages[k]["resident"] for k in ("start", "after torch.ones(256 MiB)", "after del"))
    assert allocated - start > 200 * MiB  # the pages were touched, so they count
    assert allocated - freed > 200 * MiB  # and over glibc's mmap threshold they go straight back


@cuda
def test_empty_cache_frees_what_the_caching_allocator_kept_reserved():
    stages = dict(memory.empty_cache_demo(torch.device("cuda", 0), mib=256))
    after_del, emptied = stages["after del"], stages["after torch.cuda.empty_cache()"]
    assert after_del["allocated"] < stages["after torch.ones(256 MiB)"]["allocated"]
    assert after_del["reserved"] - emptied["reserved"] >= 256 * MiB


def test_largest_batch_search_finds_the_boundary():
    need = lambda b: 1000 * b + 5000  # noqa: E731  bytes a step of batch b needs
    batch, used = savers.largest_batch(need, budget=1000 * 300 + 5000)
    assert batch in range(292, 301) and used == need(batch)  # within 3%, with the bytes measured for it
    assert savers.largest_batch(need, budget=1000) == (0, None)  # not even the smallest fits
    assert savers.largest_batch(need, budget=10**12, cap=4096)[0] == 4096
    out_of_memory = lambda b: None if b > 100 else need(b)  # noqa: E731  e.g. CUDA raised OutOfMemoryError
    assert savers.largest_batch(out_of_memory, budget=10**12)[0] in range(97, 101)


BUDGET = 16 * MiB  # the largest batches searched fit in it (fp32 19, checkpointing 32; the test takes 13 s here;
#   at 12 MiB 25% more batch once still fitted: small batches round 5/4 down)


@pytest.mark.slow
def test_memory_savers_save_memory_and_checkpointing_changes_nothing_else(monkeypatch):
    # The transformer: activations dominate its memory. (On the MLP at batch 256 the 3.7M parameters do,
    # and autocast *adds* memory there: it keeps bf16 copies of the weights.)
    torch.set_num_threads(1)  # the suite's other process is busy too: 2 threads here ran 3-4x slower than alone
    cpu = torch.device("cpu")
    results = {r.mode: r for r in savers.run("transformer", cpu, batch=16, budget=None, steps=3, repeats=1)}
    fp32 = results["fp32"]
    # Recomputing activations gives bitwise the same forward: the loss after 3 steps is the same.
    assert results["checkpointing"].loss_after == pytest.approx(fp32.loss_after, abs=1e-6)
    assert results["autocast"].loss_after == pytest.approx(fp32.loss_after, rel=0.02)  # bf16 matmuls
    for mode in ("autocast", "checkpointing", "both"):  # at batch 16: 0.77x, 0.76x, 0.65x; at 128: 0.62x, 0.60x, 0.41x
        assert results[mode].memory_bytes < fp32.memory_bytes, (mode, results[mode].memory_bytes, fp32.memory_bytes)
    # The largest batch in a budget, searched with real training steps: fp32 and checkpointing only (bf16
    # autocast is slow on this CPU: its search took 18 s of the test's 48)
    monkeypatch.setattr(savers, "MODES", {m: savers.MODES[m] for m in ("fp32", "checkpointing")})
    searched = {r.mode: r for r in savers.run("transformer", cpu, batch=32, budget=BUDGET, steps=1, repeats=1)}
    for r in searched.values():
        assert r.largest_batch > 0 and r.largest_batch_bytes <= BUDGET
        # The boundary is real: 25% more does not fit (repeat measurements varied by up to 3% here).
        assert savers._memory_or_none("transformer", r.mode, cpu, r.largest_batch * 5 // 4) > BUDGET
    assert searched["checkpointing"].largest_batch > searched["fp32"].largest_batch  # 32 against 19 here


def _saver(mode: str, p50: float, fastest: float | None = None, others: float = 0.0) -> savers.Result:
    stats = {"p50_ms": p50, "min_ms": fastest or p50 * 0.97, "max_ms": p50 * 1.05, "n": 5}
    return savers.Result(mode, "float32", stats, 10 * MiB, 2.0, others_cpu=others)


def test_checkpointing_faster_than_fp32_is_flagged_not_printed_as_a_speedup(monkeypatch, capsys):
    from parallel.basics import cli as basics_cli

    results = [_saver("fp32", 19.0), _saver("autocast", 12.0), _saver("checkpointing", 10.0), _saver("both", 13.0)]
    flags = basics_cli.memory_flags(results)
    assert list(flags) == ["checkpointing"]  # 1.90x faster than fp32: it recomputes, so it cannot be
    assert "1.90x faster than fp32, which cannot be: checkpointing recomputes" in flags["checkpointing"][0]
    monkeypatch.setattr(savers, "run", lambda *a, **k: results)
    # A quiet machine: otherwise a busy one (the suite's other process) adds a note on every figure.
    monkeypatch.setattr(implausible, "Watch", lambda: SimpleNamespace(stop=lambda: None))
    monkeypatch.setenv("COLUMNS", "300")  # one line a row and a note
    assert cli.main(["bench", "memory", "--device", "cpu", "--budget-mb", "0"]) == 0
    out = capsys.readouterr().out
    assert "1.90x noisy" in out  # the cell itself is marked
    (note,) = [line for line in out.splitlines() if line.startswith("noisy:")]
    assert "checkpointing step time" in note and "rerun" in note


def test_bench_flags_spread_load_and_clocks_that_cannot_be_right():
    from parallel.basics import cli as basics_cli

    assert basics_cli.memory_flags([_saver("fp32", 10.0), _saver("checkpointing", 12.0)]) == {}
    flags = basics_cli.memory_flags([_saver("fp32", 10.0, fastest=4.0, others=0.5), _saver("checkpointing", 12.0)])
    assert "2.5x its fastest repeat" in flags["fp32"][0] and "50% of the machine's CPU" in flags["fp32"][1]

    def line(device, synced, naive, others=0.0):
        stats = lambda ms: {"p50_ms": ms, "min_ms": ms * 0.95, "max_ms": ms * 1.1, "n": 5}  # noqa: E731
        return bench.Line("case", device, stats(synced), stats(naive), others)

    assert basics_cli.line_flags(line("cpu", 10.0, 10.5)) == []
    assert basics_cli.line_flags(line("cuda:0", 10.0, 0.05)) == []  # the pitfall itself is no noise
    assert "on the CPU both clocks time the same" in basics_cli.line_flags(line("cpu", 10.0, 30.0))[0]
    assert "the synchronized clock waits" in basics_cli.line_flags(line("cuda:0", 1.0, 5.0))[0]
    assert "of the machine's CPU" in basics_cli.line_flags(line("cpu", 10.0, 10.0, others=0.3))[0]
