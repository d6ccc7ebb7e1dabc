"""`python -m parallel plan`: a model and a cluster in, a layout (or the ranking of all) out."""

from __future__ import annotations

import dataclasses
import json
import math

from parallel.kit.ulysses import heads_problem
from parallel.plan import models, search
from parallel.plan.hardware import GPUS, cluster
from parallel.plan.layouts import ELEM, Training
from parallel.plan.stacks import STACKS
from parallel.world.errors import ConfigError

# Context parallelism came to Megatron-LM in 2024; the Playbook's nanotron sweep ran none (no cp in its rows)
NO_CONTEXT_PARALLEL = {"megatron-2022", "nanotron"}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="which parallel layout for a model on a cluster: memory and step time, "
                                    "predicted; --validate checks the model against published runs")
    m = p.add_argument_group("model (a preset, flags, or --model; flags override a preset's fields)")
    m.add_argument("--preset", choices=sorted(models.PRESETS), help="a published model's shape")
    m.add_argument("--model", metavar="FILE.py:FACTORY", help="your model: its Hugging Face config is read")
    m.add_argument("--arch", choices=("gpt", "llama"), help="gpt: GELU, biases, tied head; llama: SwiGLU, GQA")
    for flag, what in (("layers", "L"), ("hidden", "H"), ("heads", "A"), ("vocab", "V"), ("seq", "S"),
                       ("ffn", "F (default 4H)"), ("kv-heads", "G (default A)"), ("experts", "E"), ("top-k", "K")):
        also = ["--seq-len"] if flag == "seq" else []  # compare's spelling too
        m.add_argument(f"--{flag}", *also, type=int, metavar=what.split()[0], help=what)
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, help="GPUs in all")
    c.add_argument("--gpu", choices=sorted(GPUS), help="kind (a100-80gb, or a --calibration's; --calibrate: "
                   "the kind to calibrate a CPU run against)")
    c.add_argument("--calibration", metavar="FILE", help="plan with the scales `plan --calibrate` wrote (its "
                   "calibration.json) for that GPU kind")
    c.add_argument("--gpus-per-node", type=int, default=8, metavar="N", help="GPUs joined by NVLink (8)")
    for flag in ("nvlink", "network", "hbm"):
        c.add_argument(f"--{flag}", type=float, metavar="GB/s", help=f"override the kind's {flag} bandwidth per GPU")
    c.add_argument("--peak", type=float, metavar="TFLOP/s", help="override the kind's dense 16-bit peak")
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, metavar="B", help="sequences per optimizer step")
    t.add_argument("--precision", default="bf16", choices=sorted(ELEM), help="bf16 (default), fp16, fp32")
    t.add_argument("--stack", default="torch", choices=sorted(STACKS), help="torch: flash attention, no "
                   "dropout, overlapped data parallel (default); megatron-2022: as the published runs")
    f = p.add_argument_group("a fixed configuration (any subset; the rest is searched)")
    for flag in ("tp", "pp", "dp", "cp", "ep", "mbs", "stages-per-rank", "zero-stage"):
        f.add_argument(f"--{flag}", type=int, metavar="N")
    f.add_argument("--ulysses", type=int, metavar="N", help="of the --cp GPUs, N by all-to-all (Ulysses), a ring "
                   "across the rest: 1 ring attention alone, N = cp the all-to-all alone")
    f.add_argument("--sequence-parallel", type=int, choices=(0, 1), metavar="0|1")
    f.add_argument("--recompute", choices=("none", "selective", "full"))
    f.add_argument("--schedule", choices=("gpipe", "1f1b", "interleavedzb"), help="pipeline schedule (1f1b; "
                   "interleaved when --stages-per-rank > 1)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="a JSON list of configurations on stdout, nothing else")
    o.add_argument("--top", type=int, default=10, metavar="N", help="layouts listed when searching (10)")
    o.add_argument("--validate", action="store_true", help="predict every published run in parallel/plan/"
                   "published.py and this machine's latest comparison; errors per row, mean and worst")
    o.add_argument("--calibrate", metavar="OUT", help="calibrate the planner on a finished comparison's single "
                   "step (OUT/results.json, the built-in transformer at a planner shape); writes OUT/calibration.json")
    o.add_argument("--sweep", metavar="FILE.csv", help="--validate: score a sweep of the Playbook's columns (model, "
                   "nodes, gpus, dp, tp, pp, zero, mbs, grad_acc, gbs_seqs, seq, mfu_pct, tok_s_gpu, mem_gb, status) "
                   "instead, as a held-out set")
    o.add_argument("--results", metavar="DIR", help="--validate: the comparison to check (default: the newest "
                   "results/run-*)")


def model_of(args) -> models.ModelShape:
    fields = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
              "seq": args.seq, "ffn": args.ffn, "kv_heads": args.kv_heads, "experts": args.experts,
              "top_k": args.top_k, "arch": args.arch}
    given = {k: v for k, v in fields.items() if v is not None}
    try:
        if args.preset and args.model:
            raise ValueError("give --preset or --model, not both")
        if args.preset:
            return dataclasses.replace(models.PRESETS[args.preset], **given)
        read = models.from_module(args.model) if args.model else {}
        given = read | given
        missing = [f"--{k}" for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in given]
        if missing:
            where = f"{args.model} does not say" if args.model else "the model needs"
            raise ValueError(f"{where} {' '.join(missing)} (give them, or --preset NAME, or --model FILE.py:FACTORY)")
        return models.ModelShape(**given)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def fixed_of(args) -> dict:
    keys = ("tp", "pp", "dp", "cp", "ulysses", "ep", "mbs", "stages_per_rank", "zero_stage", "recompute", "schedule")
    fixed = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    if args.sequence_parallel is not None:
        fixed["sequence_parallel"] = bool(args.sequence_parallel)
    for k, v in fixed.items():
        if isinstance(v, int) and not isinstance(v, bool) and v < (0 if k == "zero_stage" else 1):
            raise ConfigError(f"--{k.replace('_', '-')} {v}: must be at least {0 if k == 'zero_stage' else 1}")
    if fixed.get("zero_stage", 0) > 3:
        raise ConfigError(f"--zero-stage {fixed['zero_stage']}: 0, 1, 2 or 3")
    return fixed


def check(model, cl, train, fixed) -> None:
    """The flags' own conditions, each refused in one line (what depends on the search is left to it)."""
    def fail(text):
        raise ConfigError(text)
    if cl.gpus < 1:
        fail("--gpus: at least 1")
    if train.global_batch < 1:
        fail("--global-batch: at least 1 sequence")
    dims = [fixed[k] for k in ("tp", "pp", "dp", "cp") if k in fixed]
    if len(dims) == 4 and math.prod(dims) != cl.gpus:
        fail(f"--tp x --pp x --dp x --cp = {math.prod(dims)}, not --gpus {cl.gpus}")
    if "tp" in fixed and model.kv % fixed["tp"]:
        fail(f"--tp {fixed['tp']} does not divide the {model.kv} key/value heads")
    if "cp" in fixed and model.seq % fixed["cp"]:
        fail(f"--cp {fixed['cp']} does not divide the sequence of {model.seq}")
    if "cp" in fixed and fixed["cp"] % fixed.get("ulysses", 1):
        fail(f"--ulysses {fixed['ulysses']} does not divide --cp {fixed['cp']}")
    if fixed.get("ulysses", 1) > 1 and (why := heads_problem(model.heads // fixed.get("tp", 1),
                                                              model.kv // fixed.get("tp", 1), fixed["ulysses"])):
        fail(f"--ulysses {fixed['ulysses']}: {why}")
    if fixed.get("ep", 1) > 1 and not model.experts:
        fail(f"--ep {fixed['ep']}: the model has no experts (--experts E)")
    if model.experts and model.experts % fixed.get("ep", 1):
        fail(f"--ep {fixed['ep']} does not divide the {model.experts} experts")
    if fixed.get("pp", 1) * fixed.get("stages_per_rank", 1) > model.layers:
        fail(f"--pp x --stages-per-rank = {fixed.get('pp', 1) * fixed.get('stages_per_rank', 1)}, more stages "
             f"than the {model.layers} layers")
    if fixed.get("stages_per_rank", 1) > 1 and fixed.get("pp") == 1:
        fail("--stages-per-rank interleaves pipeline stages: it needs --pp 2 or more")
    if fixed.get("schedule") == "interleavedzb" and fixed.get("stages_per_rank", 2) < 2:
        fail("--schedule interleavedzb holds 2 or more stages a rank (torch asserts it): --stages-per-rank 2+")
    if fixed.get("zero_stage", 0) and fixed.get("dp", 2) * fixed.get("cp", 1) == 1:
        fail(f"--zero-stage {fixed['zero_stage']} shards over data-parallel ranks: --dp 1 (and --cp 1) has none")
    if model.top_k > 1 and not model.experts:
        fail(f"--top-k {model.top_k} routes to experts: give --experts E")
    if fixed.get("sequence_parallel") and fixed.get("tp") == 1:
        fail("--sequence-parallel 1 splits what tensor parallelism leaves whole: it needs --tp 2 or more")
    if cl.gpus % math.prod(dims):
        fail(f"the dimensions given multiply to {math.prod(dims)}, which does not divide --gpus {cl.gpus}")
    if "dp" in fixed and train.global_batch % (fixed["dp"] * fixed.get("mbs", 1)):
        fail(f"--global-batch {train.global_batch} does not divide into --dp {fixed['dp']} x --mbs "
             f"{fixed.get('mbs', 1)}")


def main(args, console) -> int:
    if args.sweep and not args.validate:
        raise ConfigError("--sweep scores a sweep with --validate: plan --validate --sweep FILE.csv")
    if args.validate:
        from parallel.plan import report

        return report.validate(args, console)
    if args.calibrate:
        from parallel.plan import calibrate

        return calibrate.main(args, console)
    model = model_of(args)
    if args.gpus is None or args.global_batch is None:
        raise ConfigError("plan needs --gpus N and --global-batch B (or --validate)")
    over = {"nvlink": args.nvlink, "network": args.network, "hbm": args.hbm, "peak": args.peak}
    for k, v in over.items():
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ConfigError(f"--{k} must be a positive number, got {v:g}")
    if args.gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
    if args.top < 1:
        raise ConfigError(f"--top must be at least 1, got {args.top}")
    over = {k: v * (1e12 if k == "peak" else 1e9) for k, v in over.items() if v is not None}
    kind, calibrated = args.gpu or "a100-80gb", None
    if args.calibration:
        from parallel.plan import calibrate

        kind, over["efficiency"], calibrated = calibrate.load(args.calibration, args.gpu)
    try:
        cl = cluster(args.gpus, kind, args.gpus_per_node, **over)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    train = Training(args.global_batch, args.precision, **STACKS[args.stack])
    fixed = fixed_of(args)
    if args.stack in NO_CONTEXT_PARALLEL:
        if fixed.get("cp", 1) != 1 or fixed.get("ulysses", 1) != 1:
            raise ConfigError(f"--stack {args.stack} has no context parallelism: --cp 1 or --stack torch")
        fixed["cp"] = fixed["ulysses"] = 1
    check(model, cl, train, fixed)
    results, tried, nearest = search.search(model, cl, train, fixed)
    if not tried:
        raise ConfigError(f"no layout of {cl.gpus} GPUs matches the flags given (the GPUs must be tp x pp x dp x "
                          f"cp, the global batch divide into dp x mbs, interleaving fit the micro-batches)")
    if not results:
        results = [nearest]  # nothing fits: the one that comes closest, fits false
    if all(k in fixed for k in ("tp", "pp", "dp")):
        results = results[:1]  # a fixed configuration: the best of what was left open
    if args.json:
        extra = {"calibration": calibrated} if calibrated else {}
        close = {id(r) for r in search.tied(results)}
        print(json.dumps([_public(r) | extra | {"not_told_apart_from_first": id(r) in close}
                          for r in results[:args.top]], indent=1))
        return 0
    from parallel.plan import report

    if calibrated:
        console.print(f"Calibrated ({calibrated['file']}, on {calibrated['device'] or 'a run'}): {kind}'s device work "
                      f"x{calibrated['compute']:.4g}, its per-kernel costs x{calibrated['overhead']:.4g}.",
                      highlight=False, markup=False)
    report.show(console, model, cl, train, results, tried, args.top)
    return 0


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if k != "describe"} | {"layout_text": r["describe"]}
