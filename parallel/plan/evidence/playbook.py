"""The Ultra-Scale Playbook's H100 sweep, its one-node rows: the planner scored as a user would judge it.

The data (parallel/plan/data/playbook-h100-1node.csv, its source in data/SOURCE.md) is Hugging Face's sweep of
nanotron on 8 x H100 80GB: Llama shapes at 1B, 3B, 8B and 80B, sequence 4096, 256 sequences a step, every
layout of dp x tp x pp = 8, ZeRO 0 or 1 and the micro-batch, each with the tokens/s per GPU and the memory it
measured, or its crash. A user comes to a planner to choose, so the score leads with the choice:

- the pick: in each (model, GPUs) cell, the measured throughput of the layout the planner ranks first over
  the best measured (among the layouts that ran, as the issue measured it; and among all the sweep's
  layouts, where a pick that crashed scores 0);
- fits: "fits" against ran / crashed-or-OOM, a confusion table;
- the rank correlation (Spearman) of predicted against measured throughput in each cell;
- each row's tokens/s/GPU error and memory error.

The other rows of that sweep (2-64 nodes) are a held-out test kept outside this repository: never read here.
"""

from __future__ import annotations

import csv
import dataclasses
import statistics
from pathlib import Path

from parallel.plan.layouts import Layout
from parallel.plan.models import ModelShape, llama

DATA = Path(__file__).parent / "data" / "playbook-h100-1node.csv"
GLOBAL_BATCH = 256  # sequences a step, every row
SEQ = 4096

# The shapes whose FLOPs a token reproduce the sweep's MFU over its tokens/s within 0.5% (data/SOURCE.md):
# Llama 3.2 1B and 3B, 3.1 8B, 3 70B, with multi-head attention (kv heads = heads) and the 128,256 vocabulary.
MODELS = {
    "1B": llama("1B", 16, 2048, 32, 32, 8192, seq=SEQ),
    "3B": llama("3B", 28, 3072, 32, 32, 8192, seq=SEQ),
    "8B": llama("8B", 32, 4096, 32, 32, 14336, seq=SEQ),
    "80B": llama("80B", 80, 8192, 64, 64, 28672, seq=SEQ),
}


@dataclasses.dataclass(frozen=True)
class Run:
    model: str
    dp: int
    tp: int
    pp: int
    zero: int
    mbs: int
    grad_acc: int
    ran: bool
    tok_s_gpu: float | None  # measured tokens/s per GPU (None: crashed or out of memory)
    mem_gib: float | None  # the sweep's "GB": nanotron logs MiB, read here as GiB (MiB / 1024)
    mfu: float | None  # percent, as the sweep computed it

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def layout(self) -> Layout:
        """nanotron's layout: tensor parallel in reduce-scatter mode (sequence parallel), 1F1B, no recompute."""
        return Layout(tp=self.tp, pp=self.pp, dp=self.dp, mbs=self.mbs, zero_stage=self.zero,
                      sequence_parallel=self.tp > 1)

    @property
    def spec(self) -> ModelShape:
        return MODELS[self.model]

    @property
    def cell(self) -> tuple[str, int]:
        return self.model, self.gpus

    def describe(self) -> str:
        return f"{self.model} {self.layout.describe()}"


def runs(path: Path = DATA) -> tuple[list[Run], int]:
    """(the consistent rows, how many were dropped): a row whose mbs x grad_acc x dp is not the sweep's 256
    sequences is not the configuration it names (data/SOURCE.md). A row that is not a sweep's row at all (a
    model the planner has no shape for, a count below 1, a run without its numbers) raises ValueError naming
    its line."""
    out, dropped = [], 0
    with open(path, newline="") as f:
        for line, r in enumerate(csv.DictReader(f), start=2):
            try:
                run = _run(r)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"line {line}: {e.__class__.__name__} {e}".strip()) from None
            if run is None:
                dropped += 1
            else:
                out.append(run)
    return out, dropped


def _run(r: dict) -> Run | None:
    n = {k: int(r[k]) for k in ("dp", "tp", "pp", "zero", "mbs", "grad_acc")}
    if min(v for k, v in n.items() if k != "zero") < 1 or n["zero"] not in (0, 1, 2, 3):
        raise ValueError(f"{', '.join(f'{k} {v}' for k, v in n.items())}: counts 1 or more, zero 0-3")
    if r["model"] not in MODELS or r["status"] not in ("ok", "crashed_or_oom"):
        raise ValueError(f"model {r['model']!r} (one of {', '.join(MODELS)}), status {r['status']!r}")
    if n["mbs"] * n["grad_acc"] * n["dp"] != GLOBAL_BATCH or int(r["seq"]) != SEQ:
        return None
    ran = r["status"] == "ok"
    numbers = {k: float(r[k]) for k in ("tok_s_gpu", "mem_gb", "mfu_pct")} if ran else {}
    if ran and min(numbers.values()) <= 0:
        raise ValueError("a run that ran needs tok_s_gpu, mem_gb and mfu_pct above 0")
    return Run(r["model"], **n, ran=ran, tok_s_gpu=numbers.get("tok_s_gpu"), mem_gib=numbers.get("mem_gb"),
               mfu=numbers.get("mfu_pct"))


def predict_all(runs: list[Run], stack: dict | None = None) -> list[tuple[Run, dict]]:
    """Each run predicted at its own layout, on as many H100s (8 a node) as it used, with nanotron's stack
    (or `stack`)."""
    from parallel.plan.cost import predict
    from parallel.plan.hardware import cluster
    from parallel.plan.layouts import Training
    from parallel.plan.stacks import STACKS

    train = Training(GLOBAL_BATCH, "bf16", **(STACKS["nanotron"] if stack is None else stack))
    clusters = {n: cluster(n, "h100", 8) for n in {r.gpus for r in runs}}
    return [(r, predict(r.spec, r.layout, train, clusters[r.gpus])) for r in runs]


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 points."""
    if len(xs) < 3:
        return None

    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return num / den if den else None


def score(pairs: list[tuple[Run, dict]]) -> dict:
    """The scores of predictions (`cost.predict`'s dicts) against their runs: rows, the confusion table of
    fits, the pick and rank correlation per (model, GPUs) cell, and the summary the issue's goals name."""
    rows = []
    for run, p in pairs:
        row = {"row": run.describe(), "model": run.model, "gpus": run.gpus, "ran": run.ran, "fits": p["fits"],
               "predicted_tok_s_gpu": p["tokens_per_s_per_gpu"], "predicted_mem_gib": p["memory_gib"]["total"]}
        if run.ran:
            row |= {"tok_s_gpu": run.tok_s_gpu, "mem_gib": run.mem_gib, "mfu": run.mfu,
                    "error": p["tokens_per_s_per_gpu"] / run.tok_s_gpu - 1,
                    "mem_error": p["memory_gib"]["total"] / run.mem_gib - 1}
        rows.append(row)
    confusion = {f"{'fits' if f else 'no fit'}, {'ran' if r else 'crashed'}": sum(
        1 for x in rows if x["fits"] == f and x["ran"] == r) for f in (True, False) for r in (True, False)}
    cells = [_cell(key, [x for x in rows if (x["model"], x["gpus"]) == key])
             for key in dict.fromkeys((x["model"], x["gpus"]) for x in rows)]
    ran = [x for x in rows if x["ran"]]
    crashed = [x for x in rows if not x["ran"]]
    losses = [c["pick_loss"] for c in cells if c["pick_loss"] is not None]
    well = [abs(x["error"]) for x in ran if x["mfu"] >= 20]
    summary = {
        "pick_loss_mean": statistics.fmean(losses) if losses else None, "pick_loss_worst": max(losses, default=None),
        "pick_loss_any_mean": statistics.fmean(c["pick_loss_any"] for c in cells if c["ran"]) if losses else None,
        "crashed_called_fits": sum(x["fits"] for x in crashed) / len(crashed) if crashed else None,
        "ran_called_oom": sum(not x["fits"] for x in ran) / len(ran) if ran else None,
        "median_error_mfu20": statistics.median(well) if well else None,
        "median_error": statistics.median(abs(x["error"]) for x in ran) if ran else None,
        "median_mem_error": statistics.median(abs(x["mem_error"]) for x in ran) if ran else None,
        "spearman_mean": statistics.fmean(c["spearman"] for c in cells if c["spearman"] is not None)
        if any(c["spearman"] is not None for c in cells) else None,
        "rows": len(rows), "ran": len(ran), "crashed": len(crashed)}
    return {"rows": rows, "confusion": confusion, "cells": cells, "summary": summary}


def _cell(key: tuple[str, int], rows: list[dict]) -> dict:
    """One (model, GPUs) cell: the best measured layout, the planner's pick among those that ran and among
    all it calls fitting, the loss of each against the best, and the rank correlation."""
    ran = [x for x in rows if x["ran"]]
    out = {"model": key[0], "gpus": key[1], "layouts": len(rows), "ran": len(ran), "best": None, "pick": None,
           "pick_loss": None, "pick_any": None, "pick_loss_any": None, "spearman": None,
           "says_nothing_fits": not any(x["fits"] for x in rows)}
    if not ran:
        return out
    best = max(ran, key=lambda x: x["tok_s_gpu"])
    fit_ran = [x for x in ran if x["fits"]]
    pick = max(fit_ran, key=lambda x: x["predicted_tok_s_gpu"]) if fit_ran else None
    fitting = [x for x in rows if x["fits"]]
    pick_any = max(fitting, key=lambda x: x["predicted_tok_s_gpu"]) if fitting else None
    out |= {"best": best["row"], "best_tok_s_gpu": best["tok_s_gpu"], "pick": pick and pick["row"],
            "pick_loss": 1 - pick["tok_s_gpu"] / best["tok_s_gpu"] if pick else 1.0,  # nothing picked: all lost
            "spearman": spearman([x["predicted_tok_s_gpu"] for x in ran], [x["tok_s_gpu"] for x in ran]),
            "pick_any": pick_any and pick_any["row"], "pick_any_ran": bool(pick_any and pick_any["ran"]),
            "pick_loss_any": 1 - ((pick_any or {}).get("tok_s_gpu") or 0.0) / best["tok_s_gpu"]}
    return out
