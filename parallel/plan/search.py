"""The search: every layout of a cluster's GPUs that the model divides into, predicted, the ones that fit
ranked by throughput, and the winner explained in a sentence."""

from __future__ import annotations

import itertools

from parallel.kit.ulysses import heads_problem
from parallel.plan.cost import predict
from parallel.plan.hardware import Cluster
from parallel.plan.layouts import Layout, Training
from parallel.plan.models import ModelShape

FIELDS = ("tp", "pp", "dp", "cp", "ulysses", "ep", "mbs", "stages_per_rank", "zero_stage", "recompute",
          "sequence_parallel")


def _powers(limit: int) -> list[int]:
    return [2**k for k in range(limit.bit_length()) if 2**k <= limit]


def candidates(model: ModelShape, cl: Cluster, train: Training, fixed: dict) -> list[Layout]:
    """Layouts of exactly cl.gpus GPUs: tp a power of two within a node dividing the K, V heads; pp
    dividing the layers or a power of two (the stages then uneven by a layer); cp a power of two up to 8
    dividing the sequence, of which ulysses (a power of two) by all-to-all where the heads on a tp rank allow
    (kit/ulysses.heads_problem), the rest a ring; ep dividing the experts and dp x cp; mbs a power of two dividing each
    data-parallel rank's share of the batch; interleaving only with micro-batches in rounds of pp; ZeRO
    stages, recomputations and interleaving only as the stack runs them (Training). A value in `fixed` (the
    flags given) replaces the options and must pass the same conditions, except that a fixed tp may be any
    divisor of the K, V heads (across nodes too)."""
    n, batch = cl.gpus, train.global_batch

    def pick(name, options, ok=lambda x: True):
        if fixed.get(name) is None:
            return [x for x in options if ok(x)]
        return [fixed[name]] if ok(fixed[name]) else []
    out = []
    pps = sorted({p for p in range(1, model.layers + 1) if model.layers % p == 0} | set(_powers(model.layers)))
    for tp, cp, pp in itertools.product(pick("tp", _powers(cl.per_node), lambda t: model.kv % t == 0),
                                        pick("cp", _powers(8), lambda c: model.seq % c == 0), pick("pp", pps)):
        dp, rest = divmod(n, tp * cp * pp)
        if rest or fixed.get("dp") not in (None, dp) or batch % dp:
            continue
        for u, ep, mbs, v, zero, rc, sp in itertools.product(
                pick("ulysses", _powers(cp), lambda u, tp=tp, cp=cp: cp % u == 0
                     and not heads_problem(model.heads // tp, model.kv // tp, u)),
                pick("ep", range(1, max(1, model.experts) + 1),
                     lambda e, dp=dp, cp=cp: e == 1 or (model.experts % e == 0 and (dp * cp) % e == 0)),
                pick("mbs", _powers(batch // dp), lambda b, dp=dp: (batch // dp) % b == 0),
                pick("stages_per_rank", (1, 2, 3, 4) if train.interleaved else (1,),
                     lambda v, pp=pp: (v == 1 or 1 < pp and pp * v <= model.layers)
                     and (v > 1 or fixed.get("schedule") != "interleavedzb" or pp == 1)),
                pick("zero_stage", train.zero_stages, lambda z, dp=dp, cp=cp: z == 0 or dp * cp > 1),
                pick("recompute", train.recomputes),
                pick("sequence_parallel", (True, False), lambda on, tp=tp: not on or tp > 1)):
            if v > 1 and (batch // (dp * mbs)) % pp:  # torch's interleaved schedules: micro-batches in rounds of pp
                continue
            out.append(Layout(tp, pp, dp, cp, ep, mbs, v, zero, rc, sp, fixed.get("schedule") or "1f1b", u))
    return out


def search(model: ModelShape, cl: Cluster, train: Training, fixed: dict) -> tuple[list[dict], int, dict | None]:
    """(predictions of the layouts that fit, fastest first; how many layouts were tried; the one that
    needs the least memory, for saying by how much nothing fits)."""
    tried = [predict(model, lay, train, cl) for lay in candidates(model, cl, train, fixed)]
    fits = sorted((r for r in tried if r["fits"]), key=lambda r: (r["step_s"], r["memory_gib"]["total"]))
    nearest = min(tried, key=lambda r: r["memory_gib"]["total"], default=None)
    return fits, len(tried), nearest


def shares(r: dict) -> dict[str, float]:
    """Where a step's time goes, as shares: compute, bubble, optimizer, kernel overhead and each dimension's
    exposed communication (tensor-, context- and expert-parallel collectives sit inside compute's stage time)."""
    parts = {k: r["parts_s"][k] for k in ("compute", "bubble", "optimizer", "overhead")}
    parts |= {f"{k} comm": v for k, v in r["exposed_comm_s"].items()}
    total = sum(parts.values()) or 1.0
    return {k: v / total for k, v in parts.items() if v > 0}


# The planner's own error in ranking layouts it was not fitted to: the median |error| of tokens/s per GPU over
# the Playbook's one-node rows with each model left out of the fit (fit.leave_one_model_out: 8.1%, 5.8% and
# 8.0% for 1B, 3B and 8B, 7.3% their mean; tests/test_plan_fit.py holds this to them). Layouts predicted
# within it of the fastest are not told apart: `plan` says so, as compare says "not told apart", and crowns
# none of them.
TIE = 0.075


def tied(results: list[dict]) -> list[dict]:
    """The layouts after the first whose predicted step is within TIE of its step (throughput within 1/(1 +
    TIE)): the planner cannot order them."""
    return [r for r in results[1:] if r["step_s"] <= (1 + TIE) * results[0]["step_s"]] if results else []


MODES = {"ring": "ring attention", "a2a": "all-to-all (Ulysses)", "hybrid": "all-to-all inside a ring (USP)"}


def cp_note(best: dict, others: list[dict]) -> str:
    """Where the layout splits the sequence: its context-parallel mode, and the other modes of the same layout
    beside it, each one's step against its own (those the heads allow and that fit)."""
    lay = best["layout"]
    if lay["cp"] == 1:
        return ""
    mode = lambda u: MODES["ring" if u == 1 else "a2a" if u == lay["cp"] else "hybrid"]  # noqa: E731
    same = [r for r in others if all(r["layout"][k] == lay[k] for k in FIELDS if k != "ulysses")]
    alts = "; ".join(f"{mode(r['layout']['ulysses'])} over {r['layout']['ulysses']}: "
                     f"{r['step_s'] / best['step_s'] - 1:+.1%}" for r in same)
    return (f"; its sequence split over cp {lay['cp']} by {mode(lay['ulysses'])}"
            + (f" ({lay['ulysses']} by all-to-all)" if lay["ulysses"] > 1 else "")
            + (f", against {alts}" if alts else ", no other mode of it tried (the heads, the flags) or fitting"))


def explain(best: dict, others: list[dict], tried: int) -> str:
    """One sentence: where the fastest predicted layout's step goes, and what sets it apart: the layouts
    within the planner's own error of it (TIE: not told apart, and what they change), else the runner-up and
    the part it loses in."""
    s = shares(best)
    cost = ", ".join(f"{k} {v:.0%}" for k, v in sorted(s.items(), key=lambda kv: -kv[1])[:3])
    text = (f"{best['describe']} is predicted fastest of {len(others) + 1} layouts that fit ({tried} tried): "
            f"{best['step_s']:.2f} s a step ({cost}), {best['memory_gib']['total']:.0f} GiB a GPU")
    text += cp_note(best, others)
    if not others:
        return text + "."
    close = tied([best, *others])
    if close:
        changed = sorted({k for r in close for k in FIELDS if r["layout"][k] != best["layout"][k]})
        names = ", ".join(r["describe"] for r in close[:3]) + (f" and {len(close) - 3} more" if len(close) > 3 else "")
        return text + (f"; not told apart from it: {names} (within {TIE:.1%}, the planner's own error on models it "
                       f"was not fitted to; they change {', '.join(changed)}). Measure those before choosing.")
    rival = others[0]
    mine, theirs = shares(best), shares(rival)
    worse = max(theirs, key=lambda k: theirs[k] * rival["step_s"] - mine.get(k, 0) * best["step_s"])
    changed = ", ".join(f"{k} {rival['layout'][k]}" for k in FIELDS if rival["layout"][k] != best["layout"][k])
    return text + (f"; the runner-up ({changed}) is {rival['step_s'] / best['step_s'] - 1:.1%} slower, "
                   f"mostly in {worse}.")
