"""The key/value cache of a decoding self-attention layer, in flax's "cache" collection.

One writer for every model: :func:`write_block` appends the keys and values of the new
tokens (a whole prompt at once, or one token a step) at the cache's index.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


def write_block(
    module: nn.Module, key: jax.Array, value: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Appends a block of keys/values to the "cache" collection of ``module``.

    Called from the module's compact method when decoding. The first call, from a
    full-length [batch, max_len, heads, head_dim] input, only creates the zeroed cache
    (that pass just fixes the cache shapes) and returns its arguments and None. Each
    later call takes a [batch, T, heads, head_dim] block, writes it at ``cache_index``
    and advances the index by T.

    Returns:
      (keys, values, index): the whole cache to attend over, and the slot where this
      block starts (None on the first call).
    """
    is_init = not module.has_variable("cache", "cached_key")
    cached_k = module.variable("cache", "cached_key", jnp.zeros, key.shape, key.dtype)
    cached_v = module.variable("cache", "cached_value", jnp.zeros, value.shape, value.dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if is_init:
        return key, value, None
    i, block = index.value, key.shape[1]
    keys = jax.lax.dynamic_update_slice(
        cached_k.value, key.astype(cached_k.value.dtype), (0, i, 0, 0)
    )
    values = jax.lax.dynamic_update_slice(
        cached_v.value, value.astype(cached_v.value.dtype), (0, i, 0, 0)
    )
    cached_k.value, cached_v.value, index.value = keys, values, i + block
    return keys, values, i


def update_kv_cache(
    module: nn.Module, key: jax.Array, value: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """One step of the translation decoder: appends a [batch, 1, heads, head_dim]
    key/value (:func:`write_block`) and returns the whole cache with a mask hiding the
    slots not yet written (the first, shape-fixing call returns its arguments).

    Returns:
      (keys, values, mask) to attend with.
    """
    keys, values, i = write_block(module, key, value)
    if i is None:
        return key, value, mask
    # [1, 1, 1, max_decode_len]: this step may see slots 0..i.
    return keys, values, (jnp.arange(keys.shape[1]) <= i)[None, None, None, :]


def cached_block(
    module: nn.Module, key: jax.Array, value: jax.Array, mask: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """A language model's block of new tokens (:func:`write_block`): the whole cache,
    and ``mask`` as the caller gave it (which slots each new token sees: the caller
    knows where each row's prompt starts)."""
    keys, values, i = write_block(module, key, value)
    return (key, value, mask) if i is None else (keys, values, mask)
