"""Measurement apart from the algorithms, one home per family (sharded, pipelines, context, experts,
layers): what is measured beyond the loop's time and bytes, what is predicted, a typed result, its report
table and its picture. A strategy declares its family and lends it the callables the measurement needs:

    MEASURE = sharded.Family(step=_step)          # in the strategy's module

The measurement never imports a strategy: it sees only what it is lent, the Trainable and the Run
(`run.options`: the strategy's own, typed)."""

from __future__ import annotations

import dataclasses


class Family:
    """A family's measurement of one strategy; every method has a default that measures nothing (what a
    strategy with no MEASURE gets)."""

    def watch(self, t) -> None:
        """Before the loop, on what setup made: a family that counts inside the steps (in the loop's counted
        ones: wire.counting()) wraps what it needs here, on the instances (worker.py calls it)."""

    def extra_measurements(self, t, data, config, dist, result) -> dict:
        """Measurements beyond the loop's, after the final parameters are saved (they may train further):
        {Result.FAMILY: Result(...)}, and {"measured": results.Measured(...)} for the declared ones."""
        return {}

    def predict_step_ms(self, cal, config, row) -> float | None:
        """The cost model's step time for this strategy (report/costmodel.py); None: no formula."""
        return None

    def comm_bytes_predicted(self, model, config) -> float | None:
        """Textbook bytes a rank sends per step; None where no prediction is offered."""
        return None


def result_of(row, cls):
    """The typed result of `cls`'s family in a row (its details[cls.FAMILY]), or None."""
    d = row.details.get(cls.FAMILY) if row.status == "ok" else None
    if d is None or isinstance(d, cls):  # as extra_measurements made it (a row not yet through results.json)
        return d
    return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
