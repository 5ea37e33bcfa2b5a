"""The key/value cache of a decoding self-attention layer, in flax's "cache" collection."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp


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
