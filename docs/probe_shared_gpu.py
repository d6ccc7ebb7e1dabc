"""Which collectives and torch APIs work for two ranks sharing one GPU, per backend: the measurement behind
docs/gpus.md. On a machine with a GPU:

    python docs/probe_shared_gpu.py gloo nccl     # every call in turn; one line each, per rank
    P2P=1 python docs/probe_shared_gpu.py gloo    # also send/recv and torch's pipelining (they abort gloo)
"""

import datetime
import os
import sys
import tempfile
import time

import torch
import torch.distributed as td
import torch.multiprocessing as mp
from torch import nn


def first(e):
    s = f"{type(e).__name__}: {e}".strip().splitlines()
    return s[0][:200] if s else repr(e)


def probe(rank, world, backend, store_path, out):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    res = {}
    try:
        store = td.FileStore(store_path, world)
        kw = dict(device_id=dev) if backend == "nccl" else {}
        td.init_process_group(
            backend, store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=20), **kw
        )
    except Exception as e:
        out.put((backend, rank, "init", first(e)))
        return

    def t(name, fn):
        try:
            fn()
            torch.cuda.synchronize()
            res[name] = "ok"
        except Exception as e:
            res[name] = first(e)
        out.put((backend, rank, name, res[name]))

    def x():
        return torch.ones(8, device=dev) * (rank + 1)

    t("all_reduce", lambda: td.all_reduce(x()))
    t("all_reduce AVG", lambda: td.all_reduce(x(), op=td.ReduceOp.AVG))
    t("broadcast", lambda: td.broadcast(x(), 0))
    t("reduce", lambda: td.reduce(x(), 0))
    t("all_gather", lambda: td.all_gather([torch.empty(8, device=dev) for _ in range(world)], x()))
    t("all_gather_into_tensor", lambda: td.all_gather_into_tensor(torch.empty(8 * world, device=dev), x()))
    t("reduce_scatter", lambda: td.reduce_scatter(torch.empty(8, device=dev), [x() for _ in range(world)]))
    t("reduce_scatter_tensor", lambda: td.reduce_scatter_tensor(torch.empty(4, device=dev), x()))
    t("all_to_all_single", lambda: td.all_to_all_single(torch.empty(8, device=dev), x()))
    t(
        "all_to_all",
        lambda: td.all_to_all([torch.empty(4, device=dev) for _ in range(world)], [x()[:4] for _ in range(world)]),
    )
    t("gather", lambda: td.gather(x(), [torch.empty(8, device=dev) for _ in range(world)] if rank == 0 else None, 0))
    t("scatter", lambda: td.scatter(torch.empty(8, device=dev), [x() for _ in range(world)] if rank == 0 else None, 0))

    def sr():
        if rank == 0:
            td.send(x(), 1)
        else:
            td.recv(torch.empty(8, device=dev), 0)

    if os.environ.get("P2P"):
        t("send/recv", sr)

    def isr():
        if rank == 0:
            td.isend(x(), 1).wait()
        else:
            td.irecv(torch.empty(8, device=dev), 0).wait()

    if os.environ.get("P2P"):
        t("isend/irecv", isr)

    def batch():
        peer = 1 - rank
        ops = [td.P2POp(td.isend, x(), peer), td.P2POp(td.irecv, torch.empty(8, device=dev), peer)]
        for w in td.batch_isend_irecv(ops):
            w.wait()

    if os.environ.get("P2P"):
        t("batch_isend_irecv", batch)
    t("barrier", lambda: td.barrier())
    t("monitored_barrier", lambda: td.monitored_barrier(timeout=datetime.timedelta(seconds=10)))
    t("all_gather_object", lambda: td.all_gather_object([None] * world, {"r": rank}))

    def ddp():
        torch.manual_seed(0)
        m = nn.parallel.DistributedDataParallel(nn.Linear(8, 8).to(dev), device_ids=[0] if backend == "nccl" else None)
        m(torch.randn(4, 8, device=dev)).sum().backward()

    t("DDP", ddp)

    def fsdp2():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (world,))
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).to(dev)
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        m(torch.randn(4, 8, device=dev)).sum().backward()

    t("FSDP2 fully_shard", fsdp2)

    def dtensor():
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        mesh = init_device_mesh("cuda", (world,))
        d = distribute_tensor(torch.arange(8.0, device=dev), mesh, [Shard(0)])
        d.redistribute(mesh, [Replicate()]).to_local()
        d.full_tensor()

    t("DTensor", dtensor)

    def pipe():
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        torch.manual_seed(0)
        part = nn.Linear(8, 8).to(dev)
        stage = PipelineStage(part, rank, world, dev)
        sched = ScheduleGPipe(stage, 2, loss_fn=lambda o, y: o.sum() if rank == world - 1 else None)
        if rank == 0:
            sched.step(torch.randn(4, 8, device=dev))
        else:
            sched.step(target=torch.zeros(4, device=dev))

    if os.environ.get("P2P"):
        t("pipelining GPipe", pipe)

    def speed():
        y = torch.randn(1 << 20, device=dev)  # 4 MiB
        for _ in range(3):
            td.all_reduce(y)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(10):
            td.all_reduce(y)
        torch.cuda.synchronize()
        res["allreduce 4MiB ms"] = (time.perf_counter() - t0) * 100
        out.put((backend, rank, "allreduce 4MiB ms", f"{res['allreduce 4MiB ms']:.2f}"))

    t("timing", speed)
    try:
        td.destroy_process_group()
    except Exception:
        pass


def main():
    backends = sys.argv[1:] or ["gloo", "nccl"]
    for b in backends:
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        path = tempfile.mktemp()
        ps = [ctx.Process(target=probe, args=(r, 2, b, path, q)) for r in range(2)]
        for p in ps:
            p.start()
        for p in ps:
            p.join(90)
        for p in ps:
            if p.is_alive():
                p.kill()
                print(b, "rank still alive after 90 s: killed")
        rows = {}
        while not q.empty():
            bk, r, name, v = q.get()
            rows.setdefault(name, {})[r] = v
        print(f"== backend {b}, 2 ranks on cuda:0, torch {torch.__version__}, nccl {torch.cuda.nccl.version()}")
        for name, d in rows.items():
            print(f"  {name:26s} r0: {d.get(0, '-')}   r1: {d.get(1, '-')}")
        print("  exit codes", [p.exitcode for p in ps])


if __name__ == "__main__":
    main()
