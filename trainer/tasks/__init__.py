"""What the trainer needs from a model family, and the table of families.

A task bundles a model, its data, its loss and its evaluation. The trainer
runs every task through the same code path: it never branches on the model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flax.linen as nn
import ml_collections

from trainer.errors import ConfigError

# The mapped axis over data replicas in the training step (a vmap axis name).
# Models may reduce over it, e.g. BatchNorm statistics over the global batch.
REPLICAS = "replicas"


@dataclasses.dataclass(frozen=True)
class Task:
    """A model family as the trainer sees it.

    Attributes:
      model: the flax module.
      init_batch: a small batch of the right dtypes for ``model.init``.
      train_data: iterator of this process's training batches (numpy dicts of
        ``global_batch_size // process_count`` rows) with ``get_state()`` /
        ``set_state()``: the input position, one global number valid for any
        process count (see ``trainer.data.feed.TrainBatches``). None for a task
        built without data.
      eval_batches: returns a fresh iterable of this process's eval batches
        (padding rows all zero, so they carry no weight).
      loss_fn: ``(variables, batch, rng, train) -> (loss_sum, (metric_sums,
        new_model_state))`` on one data replica's rows; ``metric_sums`` holds
        sums, with the normaliser under ``"weight"``.
      weight_fn: ``batch -> total weight`` the loss sum is divided by (tokens,
        examples), computed on the global batch.
      init_fn: ``(rng, batch) -> variables`` (boxed, with logical axis names).
      evaluate_extra: optional host-driven evaluation (e.g. BLEU from decoding)
        ``(variables, to_global, to_local) -> dict`` of metrics.
      flops_per_example: model FLOPs of one training example (for MFU).
      counts_tokens: whether ``"weight"`` counts tokens (then tokens/s is
        reported).
    """

    model: nn.Module
    init_batch: dict
    train_data: Iterator[dict] | None
    eval_batches: Callable[[], Iterable[dict]]
    loss_fn: Callable[..., Any]
    weight_fn: Callable[[dict], Any]
    init_fn: Callable[..., Any]
    evaluate_extra: Callable[..., dict] | None = None
    flops_per_example: float = 0.0
    counts_tokens: bool = False


def make_task(
    config: ml_collections.ConfigDict,
    *,
    process_index: int,
    process_count: int,
    with_data: bool = True,
) -> Task:
    """Builds the task named by ``config.model.name``.

    ``with_data=False`` builds the model, loss and shapes from the config alone,
    opening no dataset (no train or eval data, no host evaluation): enough to
    compile the training step ahead of time (:mod:`trainer.aot`).

    A family's builder gets ``open_data`` (this process's pipeline, or None) and
    calls it only after checking the model's config, so that a mistake there
    fails before a dataset is read or a vocabulary trained.
    """
    # Heavy imports (models, TFDS, tokenizers), on demand.
    from trainer.data import pipelines  # noqa: PLC0415
    from trainer.tasks import (  # noqa: PLC0415
        classification,
        recommendation,
        translation,
    )

    builders = {
        "transformer": translation.make_task,
        "ncf": recommendation.make_task,
        "resnet": classification.make_task,
    }
    name = config.model.name
    if name not in builders:
        raise ConfigError(f"model.name must be one of {sorted(builders)}, got '{name}'")
    open_data = None
    if with_data:
        open_data = functools.partial(pipelines.build, config, process_index, process_count)
    return builders[name](config, open_data)
