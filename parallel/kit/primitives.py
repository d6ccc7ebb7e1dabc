"""The four primitives nn.DataParallel runs on every forward pass, written by hand.

torch.nn.parallel's own versions refuse CPU devices ("Expected a non cpu device"); these run on any
device list, including N virtual devices on one CPU, so the mechanics can be run and timed anywhere.

    input (B, ...) --scatter--> x0 (B/N) on dev0, x1 (B/N) on dev1, ...
    module ------replicate----> replica0 on dev0, replica1 on dev1, ...   (params: differentiable copies)
    parallel_apply: one thread per device runs replica_i(x_i)
    outputs --gather--> (B, ...) on the output device; backward flows through every copy to the
                        original parameters, summing the replicas' gradients there
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable, Sequence

import torch
from torch import nn

from parallel.loop import wire
from parallel.world.devices import device_context


def device_label(device: torch.device, i: int) -> str:
    """How errors and traces name the i-th device: virtual CPU devices share torch.device("cpu")."""
    return str(device) if device.type != "cpu" else f"cpu:{i} (virtual)"


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One replica per device. A replica's parameters are `p.to(device, copy=True)`: differentiable
    copies, so each replica's backward sends its gradient back to the original parameter, where the
    replicas' gradients add up: what torch's Broadcast / ReduceAddCoalesced pair does. Buffers are
    copied without gradient. Each call builds fresh copies: the originals change at every step. Counted
    as moved: the parameters to every device but the first, and their gradients back."""
    wire.moved(module.parameters(), times=2 * (len(devices) - 1))
    return [_replicate_one(module, device, {}) for device in devices]


def _replicate_one(module: nn.Module, device: torch.device, memo: dict) -> nn.Module:
    if id(module) in memo:  # a submodule used twice stays one submodule in the replica
        return memo[id(module)]
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()  # config, hooks and flags shared; the three dicts replaced
    memo[id(module)] = replica
    # Non-leaf tensors in _parameters: nn.Module's setattr would refuse them, the dict does not.
    replica._parameters = {k: None if p is None else p.to(device, copy=True) for k, p in module._parameters.items()}
    replica._buffers = {k: None if b is None else b.detach().to(device, copy=True) for k, b in module._buffers.items()}
    replica._modules = {k: None if m is None else _replicate_one(m, device, memo) for k, m in module._modules.items()}
    return replica


def scatter(inputs, devices: Sequence[torch.device]) -> list:
    """Split tensors along dim 0 into len(devices) chunks the way torch.chunk does (ceil(B/N) each, the
    last smaller; possibly fewer chunks than devices, e.g. 4 rows on 3 devices -> 2 chunks of 2), and
    move chunk i to device i. Tuples, lists and dicts are scattered element-wise; anything else is
    given to every device as it is. Counted as moved: every chunk but the first."""
    if isinstance(inputs, torch.Tensor):
        chunks = inputs.chunk(len(devices))
        wire.moved(chunks[1:])
        return [c.to(d, non_blocking=True) for c, d in zip(chunks, devices, strict=False)]
    if isinstance(inputs, (tuple, list)) and inputs:
        per_item = [scatter(x, devices) for x in inputs]
        return [type(inputs)(parts) for parts in zip(*per_item, strict=False)]
    if isinstance(inputs, dict) and inputs:
        per_key = {k: scatter(v, devices) for k, v in inputs.items()}
        n = min(len(v) for v in per_key.values())
        return [{k: v[i] for k, v in per_key.items()} for i in range(n)]
    return [inputs for _ in devices]


class DeviceThreads:
    """One long-lived worker thread per device, each with `threads_per_device` intra-op threads (set per
    thread under OpenMP, so the cores are split between devices, never oversubscribed).

    torch's parallel_apply starts fresh threads on every call; keeping them alive, as autograd keeps its
    per-device threads, saved 5 ms of a 24 ms step on the CNN here (fresh threads pay their start and
    their OpenMP and oneDNN per-thread set-up at every call). Without a pool, parallel_apply makes a
    temporary one: the same code, torch's behaviour."""

    def __init__(self, devices: Sequence[torch.device], threads_per_device: int = 1):
        self.devices = list(devices)
        self._inbox = [queue.SimpleQueue() for _ in self.devices]
        self._done: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=_serve, daemon=True, name=f"device-{device_label(self.devices[i], i)}",
                                          args=(inbox, self._done, threads_per_device,
                                                f"device {device_label(self.devices[i], i).split()[0]}"))
                         for i, inbox in enumerate(self._inbox)]
        for t in self._threads:
            t.start()
        # The threads end, and are joined, when the pool is dropped or at exit: a thread that ran torch
        # ops and is still alive when the interpreter ends aborts it ("terminate called without an
        # active exception").
        weakref.finalize(self, _stop, self._inbox, self._threads)

    def run(self, fns: Sequence[Callable], inputs: Sequence) -> list:
        # Grad mode and autocast are thread-local: carry the caller's into each device thread.
        kinds = {d.type for d in self.devices}
        autocast = {t: (torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in kinds}
        state = (torch.is_grad_enabled(), autocast)
        for i, (fn, x) in enumerate(zip(fns, inputs, strict=True)):
            self._inbox[i].put((i, self.devices[i], fn, x, state))
        results, errors = [None] * len(fns), {}
        for _ in fns:
            i, ok, value = self._done.get()
            (results.__setitem__ if ok else errors.__setitem__)(i, value)
        if errors:
            i = min(errors)
            raise RuntimeError(f"replica {i} on {device_label(self.devices[i], i)} failed: "
                               f"{type(errors[i]).__name__}: {errors[i]}") from errors[i]
        return results


def _serve(inbox: queue.SimpleQueue, done: queue.SimpleQueue, threads_per_device: int, name: str) -> None:
    from parallel.loop.profiling import name_this_thread

    name_this_thread(name)  # its track in a profile: "device cpu:0", not "python"
    torch.set_num_threads(threads_per_device)
    while (job := inbox.get()) is not None:
        i, device, fn, x, (grad_enabled, autocast) = job
        enabled, dtype = autocast[device.type]
        try:
            with torch.set_grad_enabled(grad_enabled), device_context(device), \
                    torch.autocast(device.type, dtype=dtype, enabled=enabled):
                done.put((i, True, fn(*x) if isinstance(x, (tuple, list)) else fn(x)))
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller, naming the device
            done.put((i, False, e))


def _stop(inboxes, threads) -> None:
    for inbox in inboxes:
        inbox.put(None)
    for t in threads:
        if t is not threading.current_thread():
            t.join(timeout=10)


def parallel_apply(fns: Sequence[Callable], inputs: Sequence, devices: Sequence[torch.device],
                   threads_per_device: int = 1, pool: DeviceThreads | None = None) -> list:
    """Run fns[i](inputs[i]) on device i's thread and return the results in order; an exception in a
    thread is raised here, naming its device. Each thread gets its own replica: never one module shared
    by threads (torch.func.functional_call on a shared module raced here: wrong parameters in 1 of 5
    runs). A tuple input is unpacked into arguments, as in torch's parallel_apply."""
    if not len(fns) == len(inputs) <= len(devices):
        raise ValueError(f"{len(fns)} functions, {len(inputs)} inputs, {len(devices)} devices")
    pool = pool or DeviceThreads(devices[: len(fns)], threads_per_device)
    return pool.run(fns, inputs)


def gather(outputs: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Concatenate the replicas' outputs along dim 0 on `device`; differentiable, so the gradient of
    the result is split back to the replicas (what torch's Gather.backward, a Scatter, does). Counted as
    moved: every output but the first."""
    wire.moved(outputs[1:])
    return torch.cat([o.to(device, non_blocking=True) for o in outputs], dim=0)
