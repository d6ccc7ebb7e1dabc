"""`on_cpu`: CUDA code run on the CPU, each tensor marked with the GPU it would be on, and CUDA's device
rules enforced (strict_devices.py): the placing half of the CUDA stand-in.

`Place`, a torch function mode, sees the program's Python calls: a tensor asked for on cuda:i is made on
the CPU and marked cuda:i; `.device`, `.is_cuda`, `.get_device()` answer from the mark, as on the GPU (so
a tensor made "on x.device" gets x's mark); a move between marks (`.to`, `.cuda()`, `.cpu()`) copies,
though both ends are the CPU, and its gradient moves back. With strict_devices.Check it is entered in
every thread started meanwhile (modes are per thread).
"""

from __future__ import annotations

import threading

import torch
from torch.overrides import TorchFunctionMode

from tests.strict_devices import ANY, CPU, Check, mark, set_mark, tensors

_GETTERS = (torch.Tensor.device.__get__, torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__,
            torch.Tensor.get_device)  # compared with ==: each lookup of a slot's __get__ is a new object
_MOVES = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
_NAMING = (torch.device, torch._C._nn._parse_to)  # nn.Module.to parses its arguments with the latter


# ---- Python calls: where tensors are put, and what they say about it


class Place(TorchFunctionMode):
    def __init__(self, state: _State):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.state.active or func in _NAMING:  # naming a device is fine; putting a tensor there moves
            return func(*args, **kwargs)
        if func in _GETTERS:
            return _getter(func, args[0])
        if func in _MOVES:
            return self._move(func, args, kwargs)
        if func is torch.Tensor.backward:  # backward runs the program's Python (hooks, Functions' backward):
            with Place(self.state):  # under this mode, which is popped while its handler runs
                return torch.autograd.backward(*_backward_args(*args, **kwargs))
        if func is torch.Tensor.record_stream:
            return None  # streams are the stand-in's (strict_cuda.FakeStream): nothing to record
        if func is torch.Tensor.pin_memory:  # page-locked memory needs a GPU; what it holds is a CPU copy
            return torch.Tensor.clone(args[0])
        if kwargs.get("pin_memory"):
            kwargs = {**kwargs, "pin_memory": False}
        asked = self.state.asked(args, kwargs)
        mapped, kw = self.state.mapped(args, kwargs)
        out = func(*mapped, **kw)
        inputs = list(tensors((args, kwargs)))
        if isinstance(func, torch._ops.OpOverload) and asked in (None, CPU):
            # An aten op called from Python is mostly another dispatch mode (wire.py's counter) passing C++'s
            # call on, whose "cpu" is the real device's options: Check has marked it, as it would unseen.
            return out
        for t in tensors(out):
            if asked is not None:
                if any(t is i for i in inputs) and mark(t) != asked:
                    raise NotImplementedError(f"the CUDA stand-in cannot model {func} returning its input on "
                                              "another device")
                set_mark(t, asked)
            elif not inputs:  # made from nothing: on the default device
                set_mark(t, CPU, only_any=True)
        return out

    def _move(self, func, args, kwargs):
        """t.to(...), t.cuda(), t.cpu(): a copy where the marks differ, the tensor itself where they agree."""
        t, rest, state = args[0], args[1:], self.state
        if func is torch.Tensor.cuda:  # .cuda(device=None, non_blocking=False): the current GPU, or the one named
            named = kwargs.pop("device", rest[0] if rest else None)
            target = state.gpu(torch.device("cuda")) if named is None else state.device_of(named, keyword=True)
            rest = (target, *rest[1:])
        elif func is torch.Tensor.cpu:
            target, rest = CPU, (CPU,)
        else:  # .to(device, dtype, ...), .to(dtype), .to(other): a device named, or other's
            other = next((a for a in (*rest, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            named = next((d for d in (state.device_of(a, keyword=True) for a in (*rest[:1], kwargs.get("device")))
                          if d is not None), None)
            target = mark(other) if other is not None else named
        rest = tuple(state.map(a, keyword=i == 0) for i, a in enumerate(rest))
        kwargs = {k: state.map(v, keyword=k == "device") for k, v in kwargs.items()}
        if target is None or target == ANY or target == mark(t):
            return torch.Tensor.to(t, *rest, **kwargs)
        return _Move.apply(t, target, rest, kwargs)


def _backward_args(tensor, gradient=None, retain_graph=None, create_graph=False, inputs=None) -> tuple:
    return tensor, gradient, retain_graph, create_graph, None, inputs


class _Move(torch.autograd.Function):
    """A move between marks: a copy here, whose gradient is moved back to where the input was. (C++'s
    ToCopyBackward would hand the gradient back as it is, both ends being the CPU, still marked where it
    arrived: a replica's gradient would reach its original on the wrong device.)"""

    @staticmethod
    def forward(ctx, t, target, args, kwargs):
        ctx.source, ctx.dtype = mark(t), t.dtype
        out = torch.Tensor.to(t, *args, **{**kwargs, "copy": True})
        set_mark(out, target)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.to(dtype=ctx.dtype, copy=True)
        set_mark(back, ctx.source)
        return back, None, None, None


def _getter(func, t: torch.Tensor):
    m = mark(t)
    device = t.device if m == ANY else m  # ANY: its real device, as C++ sees it
    if func == torch.Tensor.device.__get__:
        return device
    if func == torch.Tensor.is_cuda.__get__:
        return device.type == "cuda"
    if func == torch.Tensor.is_cpu.__get__:
        return device.type == "cpu"
    return device.index if device.type == "cuda" else -1


# ---- the stand-in


class _State:
    """What both modes share: the StrictCuda they stand for, and whether the stand-in is on (threads it
    started may outlive it, their modes with them)."""

    def __init__(self, cuda):
        self.stand_in = cuda
        self.active = True

    def current(self) -> int:
        return self.stand_in.current if self.stand_in.current is not None else 0

    def gpu(self, device: torch.device) -> torch.device:
        """cuda:i asked for ("cuda": the current device), its index checked and logged ("to", i)."""
        index = self.current() if device.index is None else device.index
        self.stand_in.note("to", self.stand_in._index(torch.device("cuda", index)))
        return torch.device("cuda", index)

    def device_of(self, a, keyword: bool = False) -> torch.device | None:
        """The device an argument names, if it names one: a torch.device; a string, or an int (a GPU's
        index), only as `device=` or an argument of .to(...)."""
        if keyword and isinstance(a, int) and not isinstance(a, bool):
            a = torch.device("cuda", a)
        if keyword and isinstance(a, str) and a.split(":")[0] in ("cuda", "cpu"):
            a = torch.device(a)
        if isinstance(a, torch.device):
            return self.gpu(a) if a.type == "cuda" else a
        return None

    def asked(self, args, kwargs) -> torch.device | None:
        """The device a call asks for: its `device=`, or a torch.device among its arguments."""
        named = self.device_of(kwargs.get("device"), keyword=True)
        return named or next((d for d in map(self.device_of, args) if d is not None), None)

    def map(self, a, keyword: bool = False):
        """The argument with a GPU replaced by the CPU."""
        if keyword and (isinstance(a, str) and a.split(":")[0] == "cuda" or type(a) is int):
            return CPU
        return CPU if isinstance(a, torch.device) and a.type == "cuda" else a

    def mapped(self, args, kwargs) -> tuple[tuple, dict]:
        return tuple(map(self.map, args)), {k: self.map(v, keyword=k == "device") for k, v in kwargs.items()}


def _made(original, state: _State):
    """torch.tensor / as_tensor / from_numpy / frombuffer (which no mode sees): on the CPU, marked where asked."""

    def make(data, *args, **kwargs):
        device = state.device_of(kwargs.pop("device", None), keyword=True)
        if isinstance(data, torch.Tensor) and original is torch.as_tensor:  # the tensor itself where it agrees
            return data.to(**{k: v for k, v in (("device", device), ("dtype", kwargs.get("dtype"))) if v is not None})
        out = original(data, *args, **kwargs)
        set_mark(out, device or CPU)
        return out

    return make


def _overridden(args) -> bool:
    """has_torch_function, this stand-in's modes left out: a subclass of the program's own that overrides."""
    return any(getattr(type(a), "__torch_function__", None) not in (None, torch._C._disabled_torch_function_impl,
                                                                    torch.Tensor.__torch_function__) for a in args)


class on_cpu:  # noqa: N801 - a context manager, like torch's own modes
    """Tensors asked for on cuda:i are made on the CPU, marked cuda:i, and CUDA's device rules enforced on
    them; every request for cuda:i is logged ("to", i) in the stand-in's log. The torch.cuda calls torch's
    own distributed code makes (streams, events, the current device) go to the stand-in (strict_cuda)."""

    MADE = ("tensor", "as_tensor", "from_numpy", "frombuffer")

    def __init__(self, cuda):
        self.state = _State(cuda)
        self._undo: list = []

    def _modes(self) -> list:
        modes = [Place(self.state), Check(self.state)]
        for m in modes:
            m.__enter__()
        return modes

    def _patch(self, owner, name, value) -> None:
        self._undo.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def __enter__(self):
        self.state.active = True
        start, enter = threading.Thread.start, self._modes

        def started(thread):  # a thread started meanwhile (a device's, a stage's) runs under the stand-in too
            run = thread.run

            def under_modes():
                modes = enter()
                try:
                    run()
                finally:
                    for m in reversed(modes):
                        m.__exit__(None, None, None)

            thread.run = under_modes
            start(thread)

        self._patch(threading.Thread, "start", started)
        # torch.autograd.backward and grad would hand themselves to the mode, popped while it runs: they run
        # the program's Python (hooks, Functions' backward), so they run here, under it
        self._patch(torch.autograd, "has_torch_function", _overridden)
        for name in self.MADE:
            self._patch(torch, name, _made(getattr(torch, name), self.state))
        for name, value in self.state.stand_in.torch_cuda().items():
            self._patch(torch.cuda, name, value)
        self._entered = self._modes()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._entered):
            m.__exit__(*exc)
        for owner, name, value in reversed(self._undo):
            setattr(owner, name, value)
        self._undo.clear()
        self.state.active = False  # threads that outlive it see plain tensors again
