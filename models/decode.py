"""Autoregressive decoding for `models.transformer.Transformer`: key/value cache, greedy search.

This module only calls the model's `encode`/`decode` methods by name, so it need not import
`models.transformer` (which imports it) at run time.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import flax.linen as nn
import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from models.transformer import Transformer


def update_kv_cache(
    module: nn.Module, key: jax.Array, value: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Appends one step's key/value to the "cache" collection of a self-attention module.

    Called from the module's compact method when decoding. The first call, from a
    full-length [batch, max_decode_len, heads, head_dim] input, only creates the zeroed
    cache and returns its arguments unchanged (that pass just fixes the cache shapes). Each
    later call takes a [batch, 1, heads, head_dim] key/value, writes it at `cache_index` and
    returns the whole cache with a mask hiding the slots not yet written.

    Returns:
      (keys, values, mask) to attend with.
    """
    is_init = not module.has_variable("cache", "cached_key")
    cached_k = module.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_v = module.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if is_init:
        return key, value, mask
    i = index.value
    key = jax.lax.dynamic_update_slice(cached_k.value, key, (0, i, 0, 0))
    value = jax.lax.dynamic_update_slice(cached_v.value, value, (0, i, 0, 0))
    cached_k.value, cached_v.value, index.value = key, value, i + 1
    # [1, 1, 1, max_decode_len]: this step may see slots 0..i.
    return key, value, (jnp.arange(key.shape[1]) <= i)[None, None, None, :]


def greedy_decode(
    model: Transformer,
    params: Any,
    inputs: jax.Array,
    *,
    max_decode_len: int,
    eos_id: int = 1,
) -> jax.Array:
    """Greedy decoding with a key/value cache; jit-friendly (one `lax.while_loop`).

    The decoder starts from BOS (= 0) and feeds back its argmax one token at a time through
    a `decode=True` copy of the model, whose self-attention keeps keys/values in the "cache"
    collection. A sequence is finished once it emits `eos_id`; everything after is 0. The
    padding id 0 is never emitted, since teacher forcing would treat it as padding.

    Args:
      model: the `Transformer` (its config's `decode` flag is ignored).
      params: the model's "params" collection (boxed or not, float32 or bfloat16).
      inputs: int [batch, input_len] source ids, 0 = padding.
      max_decode_len: number of output positions (static).
      eos_id: end-of-sequence id.

    Returns:
      int32 [batch, max_decode_len] tokens.
    """
    params = nn.unbox(params)
    batch = inputs.shape[0]
    encoded = model.apply({"params": params}, inputs, method="encode")
    decoder = model.clone(config=dataclasses.replace(model.config, decode=True))

    def run_decoder(cache: Any, tokens: jax.Array, positions: Any) -> tuple[jax.Array, Any]:
        variables = {"params": params} if cache is None else {"params": params, "cache": cache}
        logits, mutated = decoder.apply(
            variables, encoded, inputs, tokens, targets_positions=positions, mutable=["cache"],
            method="decode",
        )  # fmt: skip
        return logits, mutated["cache"]

    # A pass over a full-length dummy target creates the cache, [batch, max_decode_len, ...]
    # per layer; only its shapes are needed, so trace it abstractly and start from zeros.
    dummy = jnp.zeros((batch, max_decode_len), jnp.int32)
    cache_shapes = jax.eval_shape(lambda t: run_decoder(None, t, None)[1], dummy)
    cache = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), cache_shapes)

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
