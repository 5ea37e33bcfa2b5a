"""The config's evaluation of a set of weights: what training runs every
``eval_every_steps`` and ``python -m trainer.evaluate`` runs on a checkpoint.

Metric sums of the jitted eval step over the task's eval batches, divided by their
total weight, then the task's host-driven metrics (BLEU from decoding, HR@10).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from trainer import experiment as experiment_lib
from trainer import faults


def make_evaluator(exp: experiment_lib.Experiment) -> Callable[[Any], dict[str, float]]:
    """Returns ``evaluate(variables) -> {"eval/<metric>": value}``.

    ``variables`` are ``{"params": ..., **model_state}`` with the params in their
    logical shapes (sharded over model axes only, e.g. ``exp.plan.to_logical`` of
    the train state, or a checkpoint restored into ``exp.logical_shardings()``).
    """
    with jax.set_mesh(exp.mesh):
        eval_step = jax.jit(exp.fns.eval_step)
    task = exp.task

    def evaluate(variables) -> dict[str, float]:
        with jax.set_mesh(exp.mesh), nn.logical_axis_rules(exp.rules):
            totals: dict[str, float] = {}
            for batch in task.eval_batches():
                sums = jax.device_get(eval_step(variables, exp.to_global(batch)))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
                faults.point("eval")
            weight = max(totals.pop("weight", 0.0), 1e-9)
            out = {f"eval/{k}": v / weight for k, v in totals.items()}
            if task.evaluate_extra is not None:
                extra = task.evaluate_extra(variables, exp.to_global, exp.to_local)
                out.update({f"eval/{k}": v for k, v in extra.items()})
        return out

    return evaluate
