"""Autoregressive decoding for `models.transformer.Transformer`: greedy and beam search
(the search itself is `models.beam_search`; the key/value cache `models.kv_cache`).

This module only calls the model's `encode`/`decode` methods by name: it imports
`models.transformer` for type annotations only.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from models.beam_search import beam_search

if TYPE_CHECKING:
    from models.transformer import Transformer


def _cached_decoder(
    model: Transformer, params: Any, inputs: jax.Array, *, max_decode_len: int, copies: int = 1
) -> tuple[Any, Any]:
    """Encodes ``inputs`` once and returns ``(run_decoder, zero cache)`` for stepwise decoding.

    ``copies`` > 1 repeats every row that many times (row r becomes rows r * copies ...
    r * copies + copies - 1), as beam search's hypotheses need. ``run_decoder(cache,
    tokens [rows, 1], positions [rows, 1]) -> (float32 logits [rows, 1, vocab], cache)``
    runs one step through a ``decode=True`` copy of the model, whose self-attention keeps
    keys/values in the "cache" collection.
    """
    params = nn.unbox(params)
    encoded = model.apply({"params": params}, inputs, method="encode")
    if copies > 1:
        encoded = jnp.repeat(encoded, copies, axis=0)
        inputs = jnp.repeat(inputs, copies, axis=0)
    decoder = model.clone(config=dataclasses.replace(model.config, decode=True))

    def run_decoder(cache: Any, tokens: jax.Array, positions: Any) -> tuple[jax.Array, Any]:
        variables = {"params": params} if cache is None else {"params": params, "cache": cache}
        logits, mutated = decoder.apply(
            variables,
            encoded,
            inputs,
            tokens,
            targets_positions=positions,
            mutable=["cache"],
            method="decode",
        )
        return logits, mutated["cache"]

    # A pass over a full-length dummy target creates the cache, [rows, max_decode_len, ...]
    # per layer; only its shapes are needed, so trace it abstractly and start from zeros.
    dummy = jnp.zeros((inputs.shape[0], max_decode_len), jnp.int32)
    cache_shapes = jax.eval_shape(lambda t: run_decoder(None, t, None)[1], dummy)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)
    return run_decoder, cache


def greedy_decode(
    model: Transformer,
    params: Any,
    inputs: jax.Array,
    *,
    max_decode_len: int,
    eos_id: int = 1,
) -> jax.Array:
    """Greedy decoding with a key/value cache; jit-friendly (one `lax.while_loop`).

    The decoder starts from BOS (= 0) and feeds back its argmax one token at a time. A
    sequence is finished once it emits `eos_id`; everything after is 0. The padding id 0
    is never emitted, since teacher forcing would treat it as padding.

    Args:
      model: the `Transformer` (its config's `decode` flag is ignored).
      params: the model's "params" collection (boxed or not, float32 or bfloat16).
      inputs: int [batch, input_len] source ids, one source a row, 0 = padding (rows
        of padding only decode to something finite and meaningless).
      max_decode_len: number of output positions (static).
      eos_id: end-of-sequence id.

    Returns:
      int32 [batch, max_decode_len] tokens.
    """
    batch = inputs.shape[0]
    run_decoder, cache = _cached_decoder(model, params, inputs, max_decode_len=max_decode_len)

    def not_finished(state: tuple) -> jax.Array:
        i, _, _, _, done = state
        return (i < max_decode_len) & ~jnp.all(done)

    def step(state: tuple) -> tuple:
        i, cache, tokens, out, done = state
        positions = jnp.full((batch, 1), i)
        logits, cache = run_decoder(cache, tokens, positions)  # [batch, 1, vocab] float32
        logits = logits[:, 0].at[:, 0].set(-jnp.inf)
        next_tokens = jnp.where(done, 0, jnp.argmax(logits, axis=-1).astype(jnp.int32))
        out = out.at[:, i].set(next_tokens)
        return i + 1, cache, next_tokens[:, None], out, done | (next_tokens == eos_id)

    state = (
        jnp.zeros((), jnp.int32),
        cache,
        jnp.zeros((batch, 1), jnp.int32),  # BOS
        jnp.zeros((batch, max_decode_len), jnp.int32),
        jnp.zeros((batch,), bool),
    )
    return jax.lax.while_loop(not_finished, step, state)[3]


def beam_decode(
    model: Transformer,
    params: Any,
    inputs: jax.Array,
    *,
    beam_size: int,
    max_decode_len: int,
    alpha: float,
    eos_id: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Beam search (`models.beam_search`) with the key/value cache; jit-friendly.

    Each source row is encoded once; its `beam_size` hypotheses decode as rows of one
    [batch * beam_size] batch whose cache rows follow them from step to step.

    Args:
      model, params, inputs, max_decode_len, eos_id: as in `greedy_decode`.
      beam_size: hypotheses kept per source.
      alpha: GNMT length-penalty exponent (0.6 in Vaswani et al.).

    Returns:
      (int32 [batch, beam_size, max_decode_len] outputs, float32 [batch, beam_size]
      length-penalised log-probabilities), best first.
    """
    batch = inputs.shape[0]
    run_decoder, cache = _cached_decoder(
        model, params, inputs, max_decode_len=max_decode_len, copies=beam_size
    )

    def step_fn(cache: Any, tokens: jax.Array, index: jax.Array) -> tuple[jax.Array, Any]:
        logits, cache = run_decoder(cache, tokens, jnp.full(tokens.shape, index))
        return logits[:, 0], cache

    return beam_search(
        step_fn,
        cache,
        batch_size=batch,
        beam_size=beam_size,
        max_len=max_decode_len,
        eos_id=eos_id,
        alpha=alpha,
        # Scanned layers keep their caches stacked: [layers, rows, ...].
        cache_axis=1 if model.config.scan_layers else 0,
    )


def decode(
    model: Transformer,
    params: Any,
    inputs: jax.Array,
    *,
    beam_size: int,
    max_decode_len: int,
    alpha: float,
    eos_id: int = 1,
) -> jax.Array:
    """The best output of each source: greedy for `beam_size` 1, else beam search.

    Returns:
      int32 [batch, max_decode_len] tokens, 0 after the first `eos_id`.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be >= 1, got {beam_size}")
    if beam_size == 1:
        return greedy_decode(model, params, inputs, max_decode_len=max_decode_len, eos_id=eos_id)
    seqs, _ = beam_decode(
        model,
        params,
        inputs,
        beam_size=beam_size,
        max_decode_len=max_decode_len,
        alpha=alpha,
        eos_id=eos_id,
    )
    return seqs[:, 0]
