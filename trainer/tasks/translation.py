"""Translation with the encoder-decoder Transformer: loss, token accuracy, and BLEU,
chrF and exact match of translations decoded greedily or with beam search
(``eval_beam_size``), with a few of them shown at each evaluation."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from models import decode as decode_lib
from models import losses, stacking, transformer
from trainer import console
from trainer.errors import ConfigError, floating_dtype
from trainer.input import translation as data_lib
from trainer.input.tokenizer import EOS_ID
from trainer.tasks import text_metrics
from trainer.tasks.base import HostEvaluation, Task

_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(transformer.TransformerConfig))


def model_config(config: ml_collections.ConfigDict) -> transformer.TransformerConfig:
    """The model's own dataclass from ``config.model`` (``name`` dropped)."""
    fields = {k: v for k, v in config.model.items() if k != "name"}
    unknown = sorted(set(fields) - set(_MODEL_KEYS))
    if unknown:
        raise ConfigError(f"config.model has keys the Transformer does not take: {unknown}")
    for key in ("dtype", "param_dtype"):
        fields[key] = floating_dtype(fields[key], f"model.{key}")
    heads, qkv = fields["num_heads"], fields["qkv_dim"]
    if heads < 1 or qkv % heads:
        raise ConfigError(
            f"model.qkv_dim={qkv} must split evenly over model.num_heads={heads} "
            f"(each head gets qkv_dim / num_heads dims)"
        )
    return transformer.TransformerConfig(**fields)


def make_decoder(
    model: transformer.Transformer, *, beam_size: int, max_decode_len: int, alpha: float
):
    """``jit((params, inputs [batch, length]) -> int32 [batch, max_decode_len])``: the best
    translation of each row, greedy for ``beam_size`` 1, else beam search with length
    penalty ``alpha``; tokens after EOS are 0."""
    if beam_size < 1:
        raise ConfigError(f"the beam size must be >= 1, got {beam_size}")
    if alpha < 0:
        raise ConfigError(f"length_penalty must be >= 0, got {alpha}")
    return jax.jit(
        lambda params, inputs: decode_lib.decode(
            model,
            params,
            inputs,
            beam_size=beam_size,
            max_decode_len=max_decode_len,
            alpha=alpha,
            eos_id=EOS_ID,
        )
    )


def make_task(
    config: ml_collections.ConfigDict, open_data: Callable[[], data_lib.TranslationData] | None
) -> Task:
    """The translation task of ``config`` on this process's data from ``open_data``
    (None: model and shapes only, see :func:`trainer.tasks.make_task`)."""
    cfg = model_config(config)
    if config.data.max_length > cfg.max_len:
        raise ConfigError(
            f"data.max_length={config.data.max_length} is longer than the model's position "
            f"table, model.max_len={cfg.max_len}"
        )
    data = open_data() if open_data else None
    if data is not None and data.vocab.vocab_size > cfg.vocab_size:
        raise ConfigError(
            f"the data's vocabulary has {data.vocab.vocab_size} ids but model.vocab_size="
            f"{cfg.vocab_size}"
        )
    model = transformer.Transformer(cfg)
    eval_model = transformer.Transformer(
        dataclasses.replace(cfg, dtype=floating_dtype(config.eval_dtype, "eval_dtype"))
    )
    length = config.data.max_length
    label_smoothing = config.label_smoothing
    init_batch = {key: np.ones((1, length), np.int32) for key in data_lib.FEATURE_KEYS}

    def packing(batch):
        # Where each packed row's examples start and which tokens belong together.
        return {
            "inputs_positions": batch["inputs_position"],
            "targets_positions": batch["targets_position"],
            "inputs_segmentation": batch["inputs_segmentation"],
            "targets_segmentation": batch["targets_segmentation"],
        }

    # Initial values are those of the unscanned model whatever model.scan_layers says:
    # stacking the layers changes where the parameters live, not the run's numbers.
    per_layer = transformer.Transformer(dataclasses.replace(cfg, scan_layers=False))

    def init_fn(rng, batch):
        args = ({"params": rng}, batch["inputs"], batch["targets"])
        if not cfg.scan_layers:
            return per_layer.init(*args, **packing(batch))
        return stacking.init_like_unscanned(model, per_layer, *args, **packing(batch))

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        logits = (model.clone(layer_weights=layer_weights) if train else eval_model).apply(
            variables,
            batch["inputs"],
            batch["targets"],
            **packing(batch),
            train=train,
            rngs={"dropout": rng} if train else {},
        )
        weights = (batch["targets"] > 0).astype(jnp.float32)
        loss, sums = losses.cross_entropy_and_metrics(
            logits, batch["targets"], weights, label_smoothing
        )
        return loss, (sums, {})

    def weight_fn(batch):
        return jnp.sum(batch["targets"] > 0).astype(jnp.float32)

    @functools.cache
    def decoder():
        return make_decoder(
            eval_model,
            beam_size=config.eval_beam_size,
            max_decode_len=config.max_decode_length,
            alpha=config.length_penalty,
        )

    def decode_eval(variables, to_global, to_local) -> HostEvaluation:
        hypotheses = []
        batches = console.progress(data.eval_batches(), desc="decoding for BLEU", unit="batches")
        for batch in batches:
            tokens = decoder()(variables["params"], to_global(batch)["inputs"])
            hypotheses += [data.vocab.decode(row) for row in np.asarray(to_local(tokens))]
        sources, references = data.eval_references()
        hypotheses = hypotheses[: len(references)]
        return HostEvaluation(
            text_metrics.corpus_metrics(hypotheses, references),
            text_metrics.samples(sources, hypotheses, references, config.eval_samples),
        )

    return Task(
        model=model,
        eval_model=eval_model,
        init_batch=init_batch,
        train_data=data and data.train,
        eval_batches=data.eval_batches if data else lambda: (),
        loss_fn=loss_fn,
        weight_fn=weight_fn,
        init_fn=init_fn,
        evaluate_extra=decode_eval if data else None,
        flops_per_example=transformer.train_flops_per_example(cfg, length, length),
        counts_tokens=True,
        run_files={data_lib.VOCAB_FILE: data.vocab.serialized}
        if data is not None and hasattr(data.vocab, "serialized")
        else {},
    )
