"""A user's model's own rounding noise, measured in the run: the rule its verdicts use where that noise
is larger than the fp32 rule allows (equivalence.Reference.noise)."""

from __future__ import annotations

import dataclasses

from parallel.judge.equivalence import (
    FLOOR,
    LOSS_FLOOR,
    NOISE_MARGIN,
    RTOL,
    TINY,
    Reference,
    Rule,
    _loss_ratios,
    _tensor_ratios,
    curves,
)


def own_noise(config, ref: Reference, rerun=None) -> Rule | None:
    """The tolerances above were measured on the built-in models; a user's model may amplify rounding far
    more (a ResNet-style CNN here: `single` on 1 vs 2 threads differed by 30% of a GroupNorm bias's
    movement after 23 steps, 3% after 4). So its noise is measured in the run, as the docstring's was: the
    same training in another, equally valid order of sums, against the baseline. On CPU devices that is
    `single` again in this process on the other thread count. On GPUs it is the batch in two accumulated
    halves (the strategy that declares HALVES, ddp's --accum 2, on one GPU: the split a data-parallel run
    makes), run by `rerun(strategy,
    config) -> (row, state)` (the runner's child, on the run's own GPU: this process never trains a GPU
    run's model on the CPU, nor holds a CUDA context). Where the worst tensor or loss step is off by more
    than RTOL / NOISE_MARGIN of its scale, the rule for the run is NOISE_MARGIN times that, and says so:
    bugs smaller than it cannot be told from this model's own noise. None where the fp32 rule stands, or
    where nothing would differ (one core, one thread a device; a batch that does not halve)."""
    from parallel import strategies
    from parallel.worker import execute
    from parallel.world.dist import Dist

    spec = config.spec
    cores = spec.threads_per_device() * spec.count
    if spec.real:
        if rerun is None or config.batch_size % 2:
            return None
        how = f"`single`'s batch in two accumulated halves on {spec.device(0)}"
        reference = strategies.halving()
        if reference is None:
            return None
        halves = dataclasses.replace(config, world_size=1, options=dict(reference.HALVES), profile=False,
                                     extras=False)
        row, state = rerun(reference, halves)
        if state is None:
            return None
        return _noise_rule(config, ref, row, state, how)
    if cores < 2 or spec.threads_per_device() == cores:
        return None
    how = f"`single` on {cores} threads against 1"
    other = dataclasses.replace(config, devices="cpu:1", world_size=1, profile=False, extras=False, out="")
    return _noise_rule(config, ref, *execute(strategies.get(strategies.BASELINE), other, Dist()), how)


def _noise_rule(config, ref: Reference, row, state, how: str) -> Rule | None:
    unit = Rule(1.0, FLOOR, LOSS_FLOOR, "")
    worst, name, _, _ = max(_tensor_ratios(ref, state, unit))
    loss = max((r for r, *_ in _loss_ratios(ref, curves(row), unit)), default=0.0)
    noise = max(worst, loss)
    if NOISE_MARGIN * noise <= RTOL:
        return None
    where = f"{name}'s movement" if worst >= loss else "the loss's movement"
    return Rule(NOISE_MARGIN * noise, FLOOR, LOSS_FLOOR,
                f"this model's own rounding noise: {how} differed by {noise:.1%} of "
                f"{where} after {config.warmup + config.steps} steps (the fp32 rule allows {RTOL:.0%}), so it is "
                f"judged at {NOISE_MARGIN}x that, {NOISE_MARGIN * noise:.0%}; bugs smaller than that cannot be told "
                "from its noise here: fewer --steps judge it more sharply")


def _measure() -> None:
    """Re-measure equivalence's docstring's noise: `single` on 1 vs 2 threads, the worst tensor's error."""
    from parallel import strategies
    from parallel.config import RunConfig
    from parallel.models.workloads import WORKLOADS
    from parallel.worker import execute
    from parallel.world.dist import Dist

    single = strategies.get(strategies.BASELINE)
    for workload in WORKLOADS:
        initial = WORKLOADS[workload].build_model(0).state_dict()
        (row, ref), (_, other) = [execute(single, RunConfig(workload=workload, devices=d).validate(), Dist())
                                  for d in ("cpu:1", "cpu:2")]
        ratios = _tensor_ratios(Reference(initial, ref, curves(row)), other, Rule(1.0, FLOOR, LOSS_FLOOR, ""))
        worst = max((err / max((ref[k].double() - initial[k].double()).abs().max().item(), TINY), k)
                    for _, k, err, _ in ratios)
        print(f"{workload}: worst noise / movement {worst[0]:.1e} ({worst[1]}); "
              f"worst against the rule {max(ratios)[0] / RTOL:.2f} of its tolerance")


if __name__ == "__main__":
    _measure()
