"""In-process data parallel: the four hand-written primitives, `manual_dp` and `data_parallel` vs `single`.

Everything here runs in this process on virtual CPU devices; the CUDA comparison with torch's own
primitives is skipped without 2 GPUs."""

import gc
import sys
import threading

import pytest
import torch
from torch import nn

from parallel import strategies
from parallel.config import RunConfig
from parallel.kit.primitives import DeviceThreads, gather, parallel_apply, replicate, scatter
from parallel.measure import sharded
from parallel.models.workloads import WORKLOADS
from parallel.worker import execute
from parallel.world.dist import Dist
from tests.conftest import judged
from tests.multirank import FP64_MARGIN

CPU2 = [torch.device("cpu")] * 2
CPU3 = [torch.device("cpu")] * 3


@pytest.mark.parametrize("devices", ["cpu:2", "cpu:3"])
@pytest.mark.parametrize("workload", ["mlp", "cnn"])
def test_manual_dp_matches_single(devices, workload):
    # 6 optimiser steps on a global batch of 32 (cpu:3 splits it 11/11/10), in float64 (tests/multirank.py:
    # FP64_MARGIN). The replicas' gradients are summed in another order than one device sums them, so only
    # rounding may differ, far below the oracle's fp64 rule (judge/equivalence.py).
    config = RunConfig(workload=workload, devices=devices, batch_size=32, steps=5, warmup=1,
                       precision="fp64").validate()
    row, verdict = judged("manual_dp", config)
    assert verdict.verdict == "match" and verdict.ratio < FP64_MARGIN, verdict
    assert row.world_size == int(devices[-1]) and row.device_kind == "virtual"
    assert set(sharded.result(row).step_phases_ms) == {f"{p}_ms" for p in
                                                            ("scatter", "replicate", "parallel_apply", "gather",
                                                             "backward", "optimizer")}


def test_data_parallel_on_cpu_is_a_labelled_pass_through():
    config = RunConfig(workload="cnn", devices="cpu:2", batch_size=32, steps=3, warmup=1).validate()
    row, state = execute(strategies.get("data_parallel"), config, Dist())
    _, ref = execute(strategies.get("single"), config, Dist())
    assert row.device_kind == "pass-through" and row.world_size == 1
    assert all(torch.equal(state[k], ref[k]) for k in ref)  # it IS single on one virtual device


def _torch_like_parallel_apply(modules, inputs, kwargs, devices):
    # torch/nn/parallel/parallel_apply.py `_worker`, on the CPU: one new thread per replica, which re-enters
    # autocast as `torch.amp.autocast(device_type, enabled=autocast_enabled)`, with no dtype
    enabled, results = torch.is_autocast_enabled("cpu"), [None] * len(modules)

    def worker(i):
        with torch.amp.autocast("cpu", enabled=enabled):
            results[i] = modules[i](*inputs[i], **kwargs[i])

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(modules))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs a CPU device list is passed through explicitly")
def test_data_parallel_replicas_compute_in_the_callers_autocast_dtype(monkeypatch):
    # A fresh thread's autocast dtype is the device type's default (thread-local): float16 on CUDA, so a bf16
    # step ran fp16 in nn.DataParallel's replicas. On the CPU the default is bfloat16, so the mirror image is
    # tested: a caller in fp16 must not get bf16 replicas.
    monkeypatch.setattr(sys.modules["torch.nn.parallel.data_parallel"], "parallel_apply", _torch_like_parallel_apply)
    config = RunConfig(workload="mlp", devices="cpu:2", batch_size=8, steps=1, warmup=0).validate()
    t = strategies.get("data_parallel").setup(nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1), None, Dist(),
                                              config)
    dp = t.model
    dp.device_ids, dp.src_device_obj = [0, 1], torch.device("cpu")  # what it holds on 2 GPUs, CPU standing in
    ins, kws = [(torch.randn(2, 4),)] * 2, [{}] * 2
    with torch.autocast("cpu", dtype=torch.float16):
        outs = dp.parallel_apply([dp.module] * 2, ins, kws)
    assert [o.dtype for o in outs] == [torch.float16] * 2
    assert [o.dtype for o in dp.parallel_apply([dp.module] * 2, ins, kws)] == [torch.float32] * 2  # fp32: no-op
    assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and not torch.is_autocast_enabled("cpu")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_data_parallel_replicas_compute_in_bf16_on_cuda():
    from parallel.strategies.data import data_parallel

    dp = data_parallel.in_callers_autocast(nn.DataParallel(nn.Linear(4, 4).cuda(0), device_ids=[0, 1]))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = dp(torch.randn(8, 4, device="cuda:0"))
    assert out.dtype == torch.bfloat16


def test_scatter_chunks_like_torch_chunk():
    x = torch.arange(32).reshape(32, 1)
    assert [c.shape[0] for c in scatter(x, CPU3)] == [11, 11, 10]
    assert [c.shape[0] for c in scatter(x[:4], CPU3)] == [2, 2]  # fewer chunks than devices, as torch
    parts = scatter((x, {"m": x * 2, "tag": "t"}), CPU2)
    assert len(parts) == 2 and torch.equal(parts[1][1]["m"], x[16:] * 2) and parts[0][1]["tag"] == "t"


def test_gradients_arrive_in_the_original_parameters():
    model = WORKLOADS["cnn"].build_model(0)
    x, y = torch.randn(10, 1, 28, 28), torch.randint(0, 10, (10,))
    nn.functional.cross_entropy(model(x), y).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    replicas = replicate(model, CPU3)
    assert all(not p.is_leaf for p in replicas[1].parameters())  # differentiable copies, not new leaves
    assert all(p.data_ptr() != q.data_ptr() for p, q in zip(model.parameters(), replicas[0].parameters(), strict=True))
    outs = parallel_apply(replicas, scatter(x, CPU3), CPU3)
    nn.functional.cross_entropy(gather(outs, torch.device("cpu")), y).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=1e-5, atol=1e-7)  # sum of 3 replicas' grads


def test_an_exception_in_a_replica_names_its_device():
    class Fragile(nn.Module):
        def forward(self, x):
            if x.shape[0] < 3:
                raise ValueError("too few rows")
            return x

    with pytest.raises(RuntimeError, match=r"replica 1 on cpu:1 \(virtual\) failed: ValueError: too few rows"):
        parallel_apply(replicate(Fragile(), CPU2), scatter(torch.zeros(5, 1), CPU2), CPU2)


def test_grad_mode_and_autocast_reach_the_threads():
    lin = nn.Linear(4, 4)
    with torch.no_grad():
        outs = parallel_apply(replicate(lin, CPU2), scatter(torch.randn(4, 4), CPU2), CPU2)
    assert not any(o.requires_grad for o in outs)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply(replicate(lin, CPU2), scatter(torch.randn(4, 4), CPU2), CPU2)
    assert all(o.dtype == torch.bfloat16 for o in outs)


def test_device_threads_end_when_the_pool_is_dropped():
    before = set(threading.enumerate())
    pool = DeviceThreads(CPU2)
    assert pool.run([lambda v: v + 1] * 2, [1, 2]) == [2, 3]
    mine = set(threading.enumerate()) - before
    assert len(mine) == 2
    del pool
    gc.collect()
    for t in mine:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in mine)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_primitives_match_torch_nn_parallel_on_cuda():
    from torch.nn.parallel import gather as t_gather
    from torch.nn.parallel import parallel_apply as t_apply
    from torch.nn.parallel import replicate as t_replicate
    from torch.nn.parallel import scatter as t_scatter

    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    results = []
    for rep, sca, app, gat in ((replicate, scatter, parallel_apply, gather),
                               (t_replicate, t_scatter, t_apply, t_gather)):
        model = WORKLOADS["cnn"].build_model(0).cuda(0)
        x = torch.randn(9, 1, 28, 28, device="cuda:0")
        ins = sca(x, devices)
        outs = app(rep(model, devices[: len(ins)]), ins, devices[: len(ins)])
        out = gat(outs, devices[0])
        out.square().mean().backward()
        results.append((out.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1], strict=True):
        torch.testing.assert_close(a, b)
