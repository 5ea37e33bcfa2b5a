"""Language modelling with the decoder (``model.name = "decoder"``): next-token cross
entropy over packed documents; eval loss, perplexity and token accuracy.

Perplexity is ``exp`` of the eval's mean negative log-likelihood per token of the
run's tokenizer (targets that continue their document: BOS is never a target, EOS
always is), so it compares runs of the same tokenizer only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import ml_collections
import numpy as np

from models import decoder, losses, rope, stacking
from trainer.errors import ConfigError, floating_dtype
from trainer.input.language import documents as documents_lib
from trainer.input.language import options as options_lib
from trainer.input.language import pipeline as pipeline_lib
from trainer.tasks import text_samples
from trainer.tasks.base import Task

_MODEL_KEYS = {f.name for f in dataclasses.fields(decoder.DecoderConfig)} - {"rope_scaling"}
# model.rope_scaling_factor > 0 turns on Llama 3.1's frequency scaling with these.
_SCALING_KEYS = {
    "rope_scaling_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "rope_original_context": "original_context",
}


def model_config(config: ml_collections.ConfigDict) -> decoder.DecoderConfig:
    """The model's own dataclass from ``config.model`` (``name`` dropped).

    Raises:
      ConfigError: an unknown key, a dtype that is not one, or heads that do not
        divide (``num_kv_heads`` must divide ``num_heads``).
    """
    fields = {k: v for k, v in config.model.items() if k != "name"}
    unknown = sorted(set(fields) - _MODEL_KEYS - set(_SCALING_KEYS))
    if unknown:
        raise ConfigError(f"config.model has keys the decoder does not take: {unknown}")
    scaling = {name: fields.pop(key) for key, name in _SCALING_KEYS.items() if key in fields}
    if scaling.get("factor", 0) > 0:
        fields["rope_scaling"] = rope.Llama3Scaling(**scaling)
    for key in ("dtype", "param_dtype", "logits_dtype"):
        fields[key] = floating_dtype(fields[key], f"model.{key}")
    try:
        return decoder.DecoderConfig(**fields)
    except ValueError as e:
        raise ConfigError(f"model: {e}") from None


def _run_files(data: pipeline_lib.LanguageData | None) -> dict[str, bytes]:
    """What a run keeps of its input: the tokenizer, and a chat template it trained with."""
    if data is None:
        return {}
    template = data.chat_template.files if data.chat_template is not None else {}
    return {**data.tokenizer.files, **template}


def make_task(
    config: ml_collections.ConfigDict, open_data: Callable[[], pipeline_lib.LanguageData] | None
) -> Task:
    """The language-modelling task of ``config`` on this process's data from
    ``open_data`` (None: model and shapes only, see :func:`trainer.tasks.make_task`)."""
    cfg = model_config(config)
    length = config.data.max_length
    if length > cfg.max_len:
        raise ConfigError(
            f"data.max_length={length} is longer than the model takes, model.max_len={cfg.max_len}"
        )
    data = open_data() if open_data else None
    if data is not None:
        documents_lib.check_vocabulary(data.tokenizer, cfg.vocab_size)
    model = decoder.Decoder(cfg)
    eval_cfg = dataclasses.replace(cfg, dtype=floating_dtype(config.eval_dtype, "eval_dtype"))
    eval_model = decoder.Decoder(eval_cfg)
    samples = None
    if data is not None and config.eval_samples > 0:
        samples = text_samples.continuations(
            decoder.Decoder(dataclasses.replace(eval_cfg, decode=True)),
            data.tokenizer,
            data.samples(config.eval_samples),
            stop_ids=data.stop_ids,
        )
    # Initial values are those of the unscanned model whatever model.scan_layers says.
    per_layer = decoder.Decoder(dataclasses.replace(cfg, scan_layers=False))
    init_batch = {key: np.ones((1, length), np.int32) for key in options_lib.DECODER_KEYS}

    def init_fn(rng, batch):
        args = ({"params": rng}, batch["inputs"])
        if not cfg.scan_layers:
            return per_layer.init(*args)
        return stacking.init_like_unscanned(model, per_layer, *args)

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        del rng  # no dropout
        logits = (model.clone(layer_weights=layer_weights) if train else eval_model).apply(
            variables,
            batch["inputs"],
            positions=batch["positions"],
            segment_ids=batch["segmentation"],
        )
        weights = batch["weights"].astype(jnp.float32)
        loss, sums = losses.cross_entropy_and_metrics(logits, batch["targets"], weights)
        return loss, (sums, {})

    def weight_fn(batch):
        return jnp.sum(batch["weights"]).astype(jnp.float32)

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
        flops_per_example=length * decoder.train_flops_per_token(cfg, length),
        counts_tokens=True,
        run_files=_run_files(data),
        input_record=data.input_record if data is not None else {},
        rows_per_epoch=data.rows_per_epoch if data is not None else 0,
        lookup_tables=() if cfg.tie_embeddings else (decoder.TOKEN_TABLE,),
    )
