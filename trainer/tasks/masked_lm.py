"""Masked language modelling with BERT (``model.name = "bert"``): cross entropy of the
original tokens at the masked positions; eval loss and masked-LM accuracy (MLPerf's
BERT target is 0.712 on its Wikipedia eval set)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from models import bert, losses, stacking
from trainer.errors import ConfigError, floating_dtype
from trainer.input.language import documents as documents_lib
from trainer.input.language import options as options_lib
from trainer.input.language import pipeline as pipeline_lib
from trainer.tasks import text_samples
from trainer.tasks.base import Task

_MODEL_KEYS = {f.name for f in dataclasses.fields(bert.BertConfig)}


def model_config(config: ml_collections.ConfigDict) -> bert.BertConfig:
    """The model's own dataclass from ``config.model`` (``name`` dropped).

    Raises:
      ConfigError: an unknown key, a dtype that is not one, or heads that do not
        split the hidden size.
    """
    fields = {k: v for k, v in config.model.items() if k != "name"}
    if unknown := sorted(set(fields) - _MODEL_KEYS):
        raise ConfigError(f"config.model has keys BERT does not take: {unknown}")
    for key in ("dtype", "param_dtype"):
        fields[key] = floating_dtype(fields[key], f"model.{key}")
    try:
        return bert.BertConfig(**fields)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def make_task(
    config: ml_collections.ConfigDict, open_data: Callable[[], pipeline_lib.LanguageData] | None
) -> Task:
    """The masked-LM task of ``config`` on this process's data from ``open_data`` (None:
    model and shapes only, see :func:`trainer.tasks.make_task`)."""
    cfg = model_config(config)
    length, predictions = config.data.max_length, config.data.max_predictions
    if length > cfg.max_len:
        raise ConfigError(
            f"data.max_length={length} is longer than the position table, model.max_len="
            f"{cfg.max_len}"
        )
    if not config.data.masked:
        raise ConfigError("data.masked must be true for BERT: its rows are masked")
    data = open_data() if open_data else None
    if data is not None:
        documents_lib.check_vocabulary(data.tokenizer, cfg.vocab_size)
    model = bert.Bert(cfg)
    eval_model = bert.Bert(
        dataclasses.replace(cfg, dtype=floating_dtype(config.eval_dtype, "eval_dtype"))
    )
    per_layer = bert.Bert(dataclasses.replace(cfg, scan_layers=False))
    init_batch = {
        key: np.ones((1, predictions if key.startswith("masked") else length), np.int32)
        for key in options_lib.MASKED_KEYS
    }

    def arguments(batch):
        return (
            batch["inputs"],
            batch["positions"],
            batch["segmentation"],
            batch["masked_positions"],
        )

    def init_fn(rng, batch):
        args = ({"params": rng}, *arguments(batch))
        if not cfg.scan_layers:
            return per_layer.init(*args)
        return stacking.init_like_unscanned(model, per_layer, *args)

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        logits = (model.clone(layer_weights=layer_weights) if train else eval_model).apply(
            variables, *arguments(batch), train=train, rngs={"dropout": rng} if train else {}
        )
        weights = batch["masked_weights"].astype(jnp.float32)
        loss, sums = losses.cross_entropy_and_metrics(logits, batch["masked_ids"], weights)
        return loss, (sums, {})

    samples = None
    if data is not None and config.eval_samples > 0:
        samples = text_samples.masked_guesses(
            eval_model,
            data.tokenizer,
            lambda: next(iter(data.eval_batches()), None),
            arguments,
            config.eval_samples,
        )

    def weight_fn(batch):
        return jnp.sum(batch["masked_weights"]).astype(jnp.float32)

    return Task(
        model=model,
        eval_model=eval_model,
        init_batch=init_batch,
        train_data=data and data.train,
        eval_batches=data.eval_batches if data else lambda: (),
        loss_fn=loss_fn,
        weight_fn=weight_fn,
        init_fn=init_fn,
        evaluate_extra=samples,
        flops_per_example=length * bert.train_flops_per_token(cfg, length, predictions),
        counts_tokens=False,
        run_files=dict(data.tokenizer.files) if data is not None else {},
        input_record=data.input_record if data is not None else {},
        rows_per_epoch=data.rows_per_epoch if data is not None else 0,
    )
