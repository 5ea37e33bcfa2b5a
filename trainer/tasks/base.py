"""What the trainer needs from a model family: the :class:`Task` record."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn

# The mapped axis over data replicas in the training step (a vmap axis name).
# Models may reduce over it, e.g. BatchNorm statistics over the global batch.
REPLICAS = "replicas"


@dataclasses.dataclass(frozen=True)
class HostEvaluation:
    """What a task's host-driven evaluation found.

    Attributes:
      metrics: metric name (without ``eval/``) -> value.
      samples: a few outputs to show beside the metrics, one line each (e.g.
        ``source => translation (reference)``); the same on every process.
    """

    metrics: dict[str, float]
    samples: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Task:
    """A model family as the trainer sees it.

    Attributes:
      model: the flax module, computing in ``model.dtype`` (training).
      eval_model: the same module computing in ``eval_dtype`` (evaluation, decoding).
      init_batch: a small batch of the right dtypes for ``model.init``.
      train_data: iterator of this process's training batches (numpy dicts of
        ``global_batch_size // process_count`` rows) with ``get_state()`` /
        ``set_state()``: the input position, one global number valid for any
        process count (see ``trainer.input.feed.TrainBatches``). None for a task
        built without data.
      eval_batches: returns a fresh iterable of this process's eval batches
        (padding rows all zero, so they carry no weight).
      loss_fn: ``(variables, batch, rng, train, layer_weights=()) -> (loss_sum,
        (metric_sums, new_model_state))`` on one data replica's rows; ``metric_sums``
        holds sums, with the normaliser under ``"weight"``. ``layer_weights``, the
        ``(stack name, transform)`` pairs of :mod:`models.layer_stack`, are the
        weights the training model's stacks compute with (``per_layer`` gathers),
        and the readers of its ``lookup_tables``.
      weight_fn: ``batch -> total weight`` the loss sum is divided by (tokens,
        examples), computed on the global batch.
      init_fn: ``(rng, batch) -> variables`` (boxed, with logical axis names).
      evaluate_extra: optional host-driven evaluation (e.g. BLEU from decoding)
        ``(variables, to_global, to_local) -> HostEvaluation``: metrics, and a few
        sample outputs to show.
      flops_per_example: model FLOPs of one training example (for MFU).
      counts_tokens: whether ``"weight"`` counts tokens (then tokens/s is
        reported).
      run_files: files a run keeps in its work directory, name -> bytes, for
        what later works on the run alone (the tokenizer, for decoding).
      rows_per_epoch: the training rows of one pass over the data, where the family
        counts them (0: it does not; ``num_train_epochs`` is refused).
      input_record: what the training input is (files, sizes, a digest), JSON-able,
        recorded in the work directory for a resume to compare with
        (:mod:`trainer.training.resume_changes`); empty where there is nothing to say.
      lookup_tables: the training model's modules whose one parameter is a token table
        it only looks rows up in, reading it through ``layer_weights``' entry of that
        name, ``(table, ids) -> rows``, when given one: ``per_layer`` then leaves the
        table sharded (:mod:`trainer.parallel.layer_gather`).
    """

    model: nn.Module
    eval_model: nn.Module
    init_batch: dict
    train_data: Iterator[dict] | None
    eval_batches: Callable[[], Iterable[dict]]
    loss_fn: Callable[..., Any]
    weight_fn: Callable[[dict], Any]
    init_fn: Callable[..., Any]
    evaluate_extra: Callable[..., HostEvaluation] | None = None
    flops_per_example: float = 0.0
    counts_tokens: bool = False
    run_files: Mapping[str, bytes] = dataclasses.field(default_factory=dict)
    input_record: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    rows_per_epoch: int = 0
    lookup_tables: tuple[str, ...] = ()
