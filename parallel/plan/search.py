"""The search: every layout of a cluster's GPUs that the model divides into, predicted, the ones that fit
ranked by throughput, and the winner explained in a sentence."""

from __future__ import annotations

import itertools

from parallel.plan.cost import Layout, Training, predict
from parallel.plan.hardware import Cluster
from parallel.plan.models import ModelSpec

FIELDS = ("tp", "pp", "dp", "cp", "ep", "mbs", "stages_per_rank", "zero_stage", "recompute", "sequence_parallel")


def _powers(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def candidates(model: ModelSpec, cl: Cluster, train: Training, fixed: dict) -> list[Layout]:
    """Layouts of exactly cl.gpus GPUs: tp a power of two within a node dividing the K, V heads; pp
    dividing the layers or a power of two (the stages then uneven by a layer); cp a power of two up to 8
    dividing the sequence; ep dividing the experts and dp x cp; mbs dividing each data-parallel rank's
    share of the batch; anything in `fixed` (the flags given) held."""
    n = cl.gpus

    def pick(name, options):
        return [fixed[name]] if fixed.get(name) is not None else options
    out = []
    for tp, cp in itertools.product(pick("tp", [t for t in _powers(cl.per_node) if model.kv % t == 0]),
                                    pick("cp", [c for c in _powers(8) if model.seq % (2 * c) == 0 or c == 1])):
        pps = sorted({p for p in range(1, model.layers + 1) if model.layers % p == 0} | set(_powers(model.layers)))
        for pp in pick("pp", pps):
            if n % (tp * cp * pp):
                continue
            dp = n // (tp * cp * pp)
            if fixed.get("dp") not in (None, dp) or train.global_batch % dp:
                continue
            eps = [e for e in range(1, model.experts + 1) if model.experts % e == 0 and (dp * cp) % e == 0] or [1]
            mbss = [b for b in _powers(train.global_batch // dp) if (train.global_batch // dp) % b == 0]
            vs = [v for v in (1, 2, 3, 4) if pp > 1 and pp * v <= model.layers] or [1]
            for ep, mbs, v, zero, rc, sp in itertools.product(
                    pick("ep", eps), pick("mbs", mbss), pick("stages_per_rank", vs),
                    pick("zero_stage", [0, 1, 3] if dp * cp > 1 else [0]),
                    pick("recompute", ["none", "selective", "full"]),
                    pick("sequence_parallel", [True, False] if tp > 1 else [False])):
                m = train.global_batch // (dp * mbs)
                if v > 1 and m % pp:  # torch's interleaved schedules take micro-batches in rounds of pp
                    continue
                out.append(Layout(tp, pp, dp, cp, ep, mbs, v, zero, rc, bool(sp) and tp > 1, fixed.get("schedule")
                                  or "1f1b"))
    return out


def search(model: ModelSpec, cl: Cluster, train: Training, fixed: dict) -> tuple[list[dict], int, dict | None]:
    """(predictions of the layouts that fit, fastest first; how many layouts were tried; the one that
    needs the least memory, for saying by how much nothing fits)."""
    tried = [predict(model, lay, train, cl) for lay in candidates(model, cl, train, fixed)]
    fits = sorted((r for r in tried if r["fits"]), key=lambda r: (r["step_s"], r["memory_gib"]["total"]))
    nearest = min(tried, key=lambda r: r["memory_gib"]["total"], default=None)
    return fits, len(tried), nearest


def shares(r: dict) -> dict[str, float]:
    """Where a step's time goes, as shares: compute, bubble, optimizer and each dimension's exposed
    communication (tensor-, context- and expert-parallel collectives sit inside compute's stage time)."""
    parts = {"compute": r["parts_s"]["compute"], "bubble": r["parts_s"]["bubble"],
             "optimizer": r["parts_s"]["optimizer"]} | {f"{k} comm": v for k, v in r["exposed_comm_s"].items()}
    total = sum(parts.values()) or 1.0
    return {k: v / total for k, v in parts.items() if v > 0}


def explain(best: dict, others: list[dict], tried: int) -> str:
    """One sentence: where the winner's step goes, and what sets it apart: the layouts within 1% of it
    (what they change), or else the runner-up and the part it loses in."""
    s = shares(best)
    cost = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s.items(), key=lambda kv: -kv[1])[:3])
    text = (f"{best['describe']} is the fastest of {len(others) + 1} layouts that fit ({tried} tried): "
            f"{best['step_s']:.2f} s a step ({cost}), {best['memory_gib']['total']:.0f} GiB a GPU")
    if not others:
        return text + "."
    close = [r for r in others if r["step_s"] <= 1.01 * best["step_s"]]
    if close:
        changed = sorted({k for r in close for k in FIELDS if r["layout"][k] != best["layout"][k]})
        verb = "is" if len(close) == 1 else "are"
        return text + (f"; {len(close)} more {verb} within 1% (changing {', '.join(changed)}): those choices "
                       f"hardly matter here, the ones they share do.")
    rival = others[0]
    mine, theirs = shares(best), shares(rival)
    worse = max(theirs, key=lambda k: theirs[k] * rival["step_s"] - mine.get(k, 0) * best["step_s"])
    changed = ", ".join(f"{k} {rival['layout'][k]}" for k in FIELDS if rival["layout"][k] != best["layout"][k])
    return text + (f"; the runner-up ({changed}) is {rival['step_s'] / best['step_s'] - 1:.1%} slower, "
                   f"mostly in {worse}.")
