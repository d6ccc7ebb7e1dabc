"""CUDA streams: a reduction on a side stream racing the producer on the default stream, and two fixes.

    python -m parallel bench streams [--trials 20]

Kernels on one stream run in order; kernels on different streams may overlap, and nothing orders them
unless you say so. The wrong version reads `x` on a side stream while the default stream is still
writing it:

    default stream:  [ ..... slow work ..... ][ x.fill_(1) ]
    side stream:     [ x.sum() ]                               <- reads x before it is written: wrong sum

The right versions make the side stream wait first, for everything queued on the default stream
(`side.wait_stream(default)`) or for one recorded point in it (`event.record()`; `side.wait_event(event)`),
and tell the caching allocator that `x` is in use on the side stream (`x.record_stream(side)`), so its
memory is not reused by the default stream while the side stream still reads it. On CPU there are no
streams: every op finishes before the next starts, so there is nothing to race.
"""

from __future__ import annotations

import torch

SLOW_CYCLES = 50_000_000  # torch.cuda._sleep: about 20-50 ms of GPU time, so the race is not a close call


def _produce(n: int, device: torch.device) -> torch.Tensor:
    """On the current (default) stream: slow work, then x = ones(n). Returns x (not yet written)."""
    x = torch.zeros(n, device=device)
    torch.cuda.synchronize(device)  # start clean: x holds zeros everywhere
    torch.cuda._sleep(SLOW_CYCLES)  # a long kernel on the default stream
    x.fill_(1.0)
    return x


def wrong(n: int, device: torch.device) -> float:
    side = torch.cuda.Stream(device)
    x = _produce(n, device)
    with torch.cuda.stream(side):
        total = x.sum()  # races the fill: may see zeros
    torch.cuda.synchronize(device)
    return total.item()


def right_wait_stream(n: int, device: torch.device) -> float:
    side = torch.cuda.Stream(device)
    x = _produce(n, device)
    side.wait_stream(torch.cuda.current_stream(device))  # everything queued so far on the default stream first
    with torch.cuda.stream(side):
        x.record_stream(side)  # x's memory is in use on `side` too
        total = x.sum()
    torch.cuda.current_stream(device).wait_stream(side)  # and the default stream waits before using `total`
    return total.item()


def right_event(n: int, device: torch.device) -> float:
    side = torch.cuda.Stream(device)
    x = _produce(n, device)
    written = torch.cuda.Event()
    written.record()  # a point in the default stream: after the fill
    side.wait_event(written)
    with torch.cuda.stream(side):
        x.record_stream(side)
        total = x.sum()
    done = torch.cuda.Event()
    done.record(side)
    torch.cuda.current_stream(device).wait_event(done)
    return total.item()


VERSIONS = {"wrong: no wait": wrong, "right: side.wait_stream(default)": right_wait_stream,
            "right: event.record(); side.wait_event(event)": right_event}


def check(device: torch.device, trials: int = 20, n: int = 1 << 22) -> dict[str, int]:
    """How many of `trials` runs of each version give the right sum (n)."""
    return {name: sum(fn(n, device) == n for _ in range(trials)) for name, fn in VERSIONS.items()}


CPU_MESSAGE = ("CUDA streams do not apply on CPU: each op finishes before the next one starts, on the calling "
               "thread, so there is nothing to race. Run this on a CUDA machine to see the race and its fixes.")
