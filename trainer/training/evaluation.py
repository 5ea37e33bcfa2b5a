"""The config's evaluation of a set of weights: what training runs every
``eval_every_steps`` and ``python -m trainer.evaluate`` runs on a checkpoint.

Metric sums of the jitted eval step over the task's eval batches, divided by their
total weight, then the task's host-driven metrics (BLEU from decoding, HR@10).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from trainer import checkpoint as checkpoint_lib
from trainer import console, faults
from trainer.parallel import batches
from trainer.reporting import metrics as metrics_lib
from trainer.training import experiment as experiment_lib
from trainer.training import step as step_lib
from trainer.workdir import storage


@dataclasses.dataclass(frozen=True)
class Evaluation:
    """An evaluation's metrics (``{"eval/<metric>": value}``) and the task's sample
    outputs (lines to show beside them; none for most tasks)."""

    metrics: dict[str, float]
    samples: tuple[str, ...] = ()


def make_evaluator(model: experiment_lib.Model) -> Callable[[Any], Evaluation]:
    """Returns ``evaluate(variables) -> Evaluation``.

    ``variables`` are ``{"params": ..., **model_state}`` with the params in their
    logical shapes (e.g. ``exp.params_to_logical`` of the train state's, or a
    checkpoint's restored into ``model.abstract_params``).
    """
    mesh = model.mesh
    with jax.set_mesh(mesh):
        eval_step = jax.jit(step_lib.make_eval_step(model.task, model.rules))
    task = model.task
    to_global = functools.partial(batches.to_global, mesh)
    to_local = functools.partial(batches.to_local, mesh)

    def evaluate(variables) -> Evaluation:
        with jax.set_mesh(mesh), nn.logical_axis_rules(model.rules):
            totals: dict[str, float] = {}
            for batch in console.progress(task.eval_batches(), desc="evaluating", unit="batches"):
                sums = jax.device_get(eval_step(variables, to_global(batch)))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
                faults.point("eval")
            weight = max(totals.pop("weight", 0.0), 1e-9)
            out = {f"eval/{k}": v / weight for k, v in totals.items()}
            if "eval/nll" in out:  # per token of the run's tokenizer
                out["eval/perplexity"] = math.exp(min(out["eval/nll"], 700.0))
            samples = ()
            if task.evaluate_extra is not None:
                extra = task.evaluate_extra(variables, to_global, to_local)
                out.update({f"eval/{k}": v for k, v in extra.metrics.items()})
                samples = extra.samples
        return Evaluation(out, samples)

    return evaluate


def restore_variables(model: experiment_lib.Model, workdir: str, step: int | None = None):
    """``(step, variables)``: the parameters and model state of checkpoint ``step``
    (default newest) of ``workdir``, read into ``model``'s shardings; the optimizer
    state is not read.

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
      CheckpointMismatchError: it is of another model.
    """
    checkpoints = checkpoint_lib.CheckpointReader(workdir)
    try:
        step = checkpoints.resolve_step(step)
        target = {"params": model.abstract_params, "model_state": model.abstract_model_state}
        restored = checkpoints.restore_state_parts(step, target)
    finally:
        checkpoints.close()
    return step, {"params": restored["params"], **restored["model_state"]}


def evaluate_checkpoint(config, workdir: str, *, step: int | None = None) -> tuple[int, Evaluation]:
    """Evaluates checkpoint ``step`` (default newest) of ``workdir`` under ``config``,
    on this process's devices; builds no optimizer.

    Returns:
      ``(step, the evaluation)``.
    """
    model = experiment_lib.build_model(config)
    with console.phase(f"reading the parameters of {workdir}"):
        step, variables = restore_variables(model, workdir, step)
    return step, make_evaluator(model)(variables)


# trainer.evaluate's TensorBoard events: a run of their own inside the run's directory,
# so that an evaluation under other settings (beam 4) never overwrites a training point.
EVENTS_SUBDIR = "evaluate"


def record_result(workdir: str, step: int, metrics: dict[str, float], overrides: dict) -> None:
    """Appends ``{"step", "eval/...", "overrides"}`` as one line to ``workdir/eval.jsonl``."""
    out = storage.AppendOnlyFile(storage.path(workdir) / "eval.jsonl")
    out.write(json.dumps({"step": step, **metrics, "overrides": overrides}) + "\n")
    out.close()


def record_events(workdir: str, step: int, metrics: dict[str, float]) -> None:
    """Writes the metrics as TensorBoard events in ``workdir/evaluate/`` (shown by
    ``tensorboard --logdir workdir`` as the run ``evaluate`` beside the training's)."""
    metrics_lib.write_events(storage.path(workdir) / EVENTS_SUBDIR, step, metrics)
