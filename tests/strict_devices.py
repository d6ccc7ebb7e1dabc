"""Where each tensor would be on a GPU, tracked while it lives on the CPU, and CUDA's device rules enforced
on every aten op: the checking half of the CUDA stand-in (the placing half, `on_cpu`, is strict_on_cpu.py).

    with on_cpu(StrictCuda(2)):                   # tests/strict_cuda.py
        x = torch.zeros(4, device="cuda:0")       # made on the CPU, marked cuda:0; x.device says cuda:0
        x + torch.ones(4)                         # RuntimeError: Expected all tensors to be on the same device ...

`Check` is a torch dispatch mode: it sees every aten op (autograd's backward, optimisers, collectives,
DTensor's and FSDP2's own), refuses what CUDA refuses, and marks each op's outputs from its inputs. The mark
lives on the tensor's storage (PyTorch keeps one Python object per storage), so views, `param.data =
moved`, nn.Parameter(t) and FSDP2's resized storages keep it; a wrapper subclass (DTensor) has its inner
tensors' marks.

The rules, as CUDA states them (torch 2.13):
- an op's tensors are on one device ("Expected all tensors to be on the same device, but found at least
  two devices, cuda:0 and cpu!"), but for a 0-dim CPU tensor, which passes as a scalar (TensorIterator's
  CPU scalars; lenient, since a few ops refuse even those), copies (`copy_`, `_to_copy`), and foreach
  kernels, whose lists need agree only position by position;
- an index is on the CPU or on the indexed tensor's device: a CPU index into a CUDA tensor is taken, a
  CUDA index into a CPU tensor refused ("indices should be either on cpu or on the same device as the
  indexed tensor (cpu)").
No false alarm: a stand-in that refuses correct code is worse than none. So a tensor whose GPU is unknown
is ANY, passes every check and takes the device of the first op that gives it one: one made before the
stand-in or in a thread it does not reach (gloo's), or by C++ from a real device's options (a backward
formula's `at::zeros(..., grad.options())`, DDP's buckets). What Python makes with no device named (a
factory, torch.tensor, from_numpy) is on the CPU, as it would be (strict_on_cpu marks it).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

CPU = torch.device("cpu")
ANY = "any"  # the mark of a tensor whose GPU cannot be known (see above)
_ATTR = "_stand_in_device"  # where the mark is kept: an attribute of the storage's Python object
# Ops whose tensors may be on different devices: copies, and set_ (the tensor takes the source's storage, mark and all)
_COPIES = {"aten::copy_", "aten::_to_copy", "aten::_copy_from", "aten::_copy_from_and_resize", "aten::set_"}
_INDEXED = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_", "aten::_unsafe_index",
            "aten::_unsafe_index_put"}
_FOREACH = ("aten::_foreach_", "aten::_fused_")
_PLAIN = (torch.Tensor, torch.nn.Parameter)


# ---- marks


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    return [i for i in (getattr(t, name) for name in t.__tensor_flatten__()[0]) if isinstance(i, torch.Tensor)]


def _wrapper(t: torch.Tensor) -> bool:
    return type(t) not in _PLAIN and is_traceable_wrapper_subclass(t)


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse and nested tensors have none of their own
        return None


def mark(t: torch.Tensor):
    """Where `t` would be: a torch.device, or ANY."""
    if _wrapper(t):
        return _common([mark(i) for i in _inner(t)]) or ANY
    return getattr(_storage(t), _ATTR, ANY)


def set_mark(t: torch.Tensor, device, only_any: bool = False) -> None:
    """Mark `t` (its storage; a wrapper's inner tensors) as on `device`; with only_any, only where it is ANY."""
    if _wrapper(t):
        for i in _inner(t):
            set_mark(i, device, only_any)
    elif (storage := _storage(t)) is not None and (not only_any or getattr(storage, _ATTR, ANY) == ANY):
        setattr(storage, _ATTR, device)


def tensors(tree):
    """The tensors of an op's arguments (tuples, lists, dicts of them): torch's pytree, faster."""
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from tensors(x)


def _common(marks) -> torch.device | None:
    return next((m for m in marks if m != ANY), None)


# ---- the rules, op by op


def _check(name: str, args, kwargs) -> torch.device | None:
    """Raise as CUDA would on this op's devices; return the device of its outputs (None: not known)."""
    if name in _COPIES:
        return None  # a copy may cross devices
    if name in _INDEXED:
        return _check_index(name, args[0], args[1], args[2:])
    if name.startswith(_FOREACH):
        return _check_foreach(name, args, kwargs)
    return _same_device(name, tensors((args, kwargs)))


def _same_device(name: str, leaves) -> torch.device | None:
    seen, scalar, unknown = None, False, False
    for t in leaves:
        if (m := mark(t)) == ANY:
            unknown = True
        elif m == CPU and t.dim() == 0:  # a CPU scalar goes with any device
            scalar = True
        elif seen is None:
            seen = m
        elif m != seen:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"{seen} and {m}! ({name}, under the CUDA stand-in)")
    return seen if seen is not None else (CPU if scalar and not unknown else None)


def _check_index(name: str, self: torch.Tensor, indices, rest) -> torch.device | None:
    at = _same_device(name, [self, *tensors(rest)])
    for i in indices:
        if isinstance(i, torch.Tensor) and at is not None and mark(i) not in (CPU, ANY, at):
            raise RuntimeError(f"indices should be either on cpu or on the same device as the indexed tensor ({at})")
    return at


def _check_foreach(name: str, args, kwargs) -> None:
    values = (*args, *kwargs.values())
    lists = [a for a in values if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    single = [a for a in values if isinstance(a, torch.Tensor)]
    for i in range(len(lists[0]) if lists else 0):
        _same_device(name, [lst[i] for lst in lists] + single)


def _mark_outputs(name: str, args, kwargs, out, at) -> None:
    outs = list(tensors(out))
    if name.startswith(_FOREACH):  # position by position, from the first list
        firsts = next((a for a in args if isinstance(a, (list, tuple)) and a), [])
        for o, src in zip(outs, firsts, strict=False):
            set_mark(o, mark(src), only_any=True)
        return
    if name == "aten::_to_copy" and kwargs.get("device") is None:
        at = mark(args[0])  # another dtype, the same device
    elif name == "aten::lift_fresh":
        at = CPU  # torch.tensor(data): Python's data, on the CPU unless a device was named (on_cpu's torch.tensor)
    # Otherwise a copy that C++ asks for onto a device names the real one, the CPU (autograd's ToCopyBackward
    # sends a gradient back to its input's device): which GPU it stands for is not known, so ANY.
    for o in outs:
        set_mark(o, ANY if at is None else at, only_any=True)


class Check(TorchDispatchMode):
    def __init__(self, state):
        super().__init__()
        self.state = state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.state.active:
            return func(*args, **kwargs)
        name, device = func._schema.name, kwargs.get("device")
        with torch._C.DisableTorchFunction():  # the bookkeeping's own calls are not the program's
            asked = None
            if isinstance(device, torch.device) and device.type == "cuda":  # aten asked for a GPU directly
                asked, kwargs = self.state.gpu(device), {**kwargs, "device": CPU}
            at = _check(name, args, kwargs)
        out = func(*args, **kwargs)  # under Place still: DTensor's dispatch, in Python, reads devices too
        with torch._C.DisableTorchFunction():
            _mark_outputs(name, args, kwargs, out, asked or at)
        return out
