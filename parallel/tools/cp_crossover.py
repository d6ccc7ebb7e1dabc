"""Ring attention against Ulysses' all-to-all, one attention layer forward and backward, by sequence length
and ranks: where each wins on this machine, and what each sends.

    python -m parallel.tools.cp_crossover [--seq 256,1024,4096] [--ranks 2,4] [--heads 8] [--head-size 64]
                                          [--rounds 5] [--json FILE]

For every rank count a set of spawned gloo ranks (one thread each, the OMP_NUM_THREADS torchrun sets) times,
on random q, k, v of each length split between them, the ring (kit/ring_attention.py, zig-zag: balanced),
the all-to-all (kit/ulysses.py) and, from 4 ranks, the hybrids (a ring of 2, 4 or 8 across the all-to-all).
The modes take turns within each round, their order turned every round, so that the machine's drift falls
on all; a time is the slowest rank's, the table's the median over rounds with the all-to-all's ratio to
the ring in the same rounds. Bytes are counted at the collectives (loop/wire.py) in one more call. On this
CPU the bytes are memory copies between processes; on GPUs a link carries them, and the winner may differ.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.table import Table

from parallel.launch.ranks import run_ranks
from parallel.loop import wire
from parallel.loop.results import atomic_write
from parallel.style.tables import size
from parallel.style.terminal import make_console
from parallel.world.errors import ConfigError


def modes(world: int) -> list[tuple[str, int]]:
    """(name, ring ranks) of each mode on `world` ranks: the ring alone, the all-to-all alone, the hybrids."""
    hybrids = [(f"a2a {world // r} x ring {r}", r) for r in (2, 4, 8) if 1 < r < world and world % r == 0]
    return [("ring", world), ("a2a", 1), *hybrids]


def _attention(world: int, ring: int, seq: int, heads: int, d: int):
    """This rank's attention of `ring` ranks passing K,V (all of them: the ring alone; 1: the all-to-all), on
    its positions of random q, k, v (batch 1); a function that runs it forward and backward."""
    import torch.distributed as td

    from parallel.kit.ring_attention import Ring, Split
    from parallel.kit.ulysses import placed

    rank = td.get_rank()
    if ring == world:
        attend = Ring(None, Split("zigzag", world, seq))
        mine = len(attend.split.positions(rank))
    else:
        attend, positions = placed(world, world, ring, "zigzag", seq, rank, td.distributed_c10d.default_pg_timeout)
        mine = len(positions)
    g = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(1, heads, mine, d, generator=g).requires_grad_() for _ in range(3))

    def step():
        out = attend(q, k, v)
        torch.autograd.grad(out, (q, k, v), out)
    return step


def _rank(rank: int, world: int, seqs: list[int], heads: int, d: int, rounds: int) -> dict:
    import torch.distributed as td

    torch.set_num_threads(1)
    out = {}
    for seq in seqs:
        steps = {name: _attention(world, ring, seq, heads, d) for name, ring in modes(world)}
        sent = {}
        for name, step in steps.items():
            step()  # warm-up
            with wire.counted(sent.setdefault(name, {})):  # the bytes of one call
                step()
        times = {name: [] for name in steps}
        for r in range(rounds):
            order = list(steps)[r % len(steps):] + list(steps)[:r % len(steps)]
            for name in order:
                td.barrier()
                start = time.perf_counter()
                steps[name]()
                elapsed = torch.tensor([time.perf_counter() - start])
                td.all_reduce(elapsed, op=td.ReduceOp.MAX)  # the slowest rank's: the layer waits for it
                times[name].append(elapsed.item() * 1e3)
        out[seq] = {name: {"ms": times[name], "sent": sum(sent[name].values())} for name in steps}
    return out


def measure(seqs: list[int], ranks: list[int], heads: int, d: int, rounds: int) -> list[dict]:
    """One row per (ranks, length, mode): median ms, its range, the ratio to the ring's in the same rounds, and
    the bytes rank 0 sent."""
    rows = []
    for world in ranks:
        got = run_ranks(_rank, world, (seqs, heads, d, rounds), timeout=600, total=3600)[0]
        for seq in seqs:
            ring = got[seq]["ring"]["ms"]
            for name, m in got[seq].items():
                ratios = [a / b for a, b in zip(m["ms"], ring, strict=True)]
                rows.append({"ranks": world, "seq": seq, "mode": name, "ms": statistics.median(m["ms"]),
                             "ms_min": min(m["ms"]), "ms_max": max(m["ms"]), "to_ring": statistics.median(ratios),
                             "sent_bytes": m["sent"]})
    return rows


def table(rows: list[dict], heads: int, d: int, rounds: int) -> Table:
    t = Table(title=f"One attention layer, forward + backward, batch 1, {heads} heads of {d}, fp32, gloo on this "
                    f"CPU: median of {rounds} rounds (min-max), ratio to the ring in the same rounds",
              title_justify="left")
    for col in ("ranks", "seq", "mode", "ms", "range", "/ ring", "sent"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for _, group in itertools.groupby(rows, key=lambda r: (r["ranks"], r["seq"])):
        group = list(group)
        best = min(group, key=lambda r: r["ms"])
        for r in group:
            t.add_row(str(r["ranks"]), str(r["seq"]), r["mode"] + (" *" if r is best else ""), f"{r['ms']:.1f}",
                      f"{r['ms_min']:.1f}-{r['ms_max']:.1f}", f"{r['to_ring']:.2f}", size(r["sent_bytes"]))
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m parallel.tools.cp_crossover", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="256,1024,4096", help="sequence lengths, comma-separated")
    p.add_argument("--ranks", default="2,4", help="rank counts, comma-separated")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    console = make_console()
    try:
        seqs, ranks = ([int(v) for v in s.split(",")] for s in (args.seq, args.ranks))
        if min(args.rounds, args.heads, args.head_size) < 1:
            raise ConfigError("--rounds, --heads and --head-size must be at least 1")
        for world, seq in itertools.product(ranks, seqs):
            if world < 2 or args.heads % world or seq % (2 * world):
                raise ConfigError(f"{world} ranks need {args.heads} heads to divide by them and --seq {seq} by "
                                  f"{2 * world} (the zig-zag ring)")
    except (ValueError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = measure(seqs, ranks, args.heads, args.head_size, args.rounds)
    console.print(table(rows, args.heads, args.head_size, args.rounds))
    if args.json:
        atomic_write(Path(args.json), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
