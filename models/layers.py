"""Blocks the model families share: token tables, normalisations, dot-product attention.

Every parameter carries logical axis names (the trainer maps them to mesh axes);
computation runs in the module's ``dtype`` with reductions, softmax and logits in
float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


def named(init: Any, *names: str) -> Any:
    """``init`` with logical axis names for the parameter it creates."""
    return nn.with_logical_partitioning(init, names)


class Embedding(nn.Module):
    """Token table ("vocab", "embed") that also produces logits through its transpose.

    Attributes:
      stddev: of the initial values; None: ``features ** -0.5`` (the tied logits then
        start at unit scale).
      lookup: ``(the table as handed, ids) -> rows`` where the table is handed in
        another form than whole (a trainer's shard of it); None: ``jnp.take``. Such a
        table is only looked up, never :meth:`attend`-ed.
    """

    num_embeddings: int
    features: int
    dtype: Any
    param_dtype: Any
    stddev: float | None = None
    lookup: Callable[[Array, Array], Array] | None = None

    def setup(self) -> None:
        std = self.features**-0.5 if self.stddev is None else self.stddev
        shape = (self.num_embeddings, self.features)
        init = nn.initializers.normal(stddev=std)
        if self.lookup is not None:  # handed in another shape: nothing to initialise
            self.embedding = self.get_variable("params", "embedding")
            return
        self.embedding = self.param(
            "embedding", named(init, "vocab", "embed"), shape, self.param_dtype
        )

    def __call__(self, ids: Array) -> Array:
        if self.lookup is not None:
            return self.lookup(self.embedding, ids).astype(self.dtype)
        return jnp.take(self.embedding, ids, axis=0).astype(self.dtype)

    def attend(self, x: Array, result_dtype: Any = jnp.float32) -> Array:
        """x @ table^T in float32: operands in ``dtype``, the product in
        ``result_dtype`` (float32: the logits are never rounded; ``dtype``: rounded,
        half the bytes of the largest activation, as MaxText's ``logits_dot_in_fp32:
        false``), then cast to float32."""
        table = self.embedding.astype(self.dtype)
        logits = jnp.einsum("...e,ve->...v", x, table, preferred_element_type=result_dtype)
        return logits.astype(jnp.float32)


class LayerNorm(nn.Module):
    """LayerNorm with statistics and affine transform in float32, output in ``dtype``."""

    dtype: Any
    param_dtype: Any
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (x.shape[-1],)
        scale = self.param("scale", named(nn.initializers.ones, "embed"), shape, self.param_dtype)
        bias = self.param("bias", named(nn.initializers.zeros, "embed"), shape, self.param_dtype)
        x = x.astype(jnp.float32)
        mean = x.mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(jnp.square(x - mean).mean(-1, keepdims=True) + self.epsilon)
        return (y * scale.astype(jnp.float32) + bias.astype(jnp.float32)).astype(self.dtype)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang and Sennrich 2019) with a learned scale: statistics in
    float32, the scale applied after rounding to ``dtype`` (as Llama's reference code
    and Hugging Face's ``LlamaRMSNorm`` do)."""

    dtype: Any
    param_dtype: Any
    epsilon: float = 1e-5

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (x.shape[-1],)
        scale = self.param("scale", named(nn.initializers.ones, "embed"), shape, self.param_dtype)
        y = x.astype(jnp.float32)
        y = y * jax.lax.rsqrt(jnp.mean(jnp.square(y), axis=-1, keepdims=True) + self.epsilon)
        return scale.astype(self.dtype) * y.astype(self.dtype)


def attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    dtype: Any,
    dropout: Callable[[Array], Array] | None = None,
) -> Array:
    """Softmax(q k^T / sqrt(d)) v for grouped queries: scores and softmax in float32.

    Args:
      q: [batch, q_len, kv_heads, group, head_dim] (``group`` query heads share a key).
      k: [batch, k_len, kv_heads, head_dim].
      v: [batch, k_len, kv_heads, head_dim].
      mask: bool, broadcastable to [batch, kv_heads, group, q_len, k_len]; True where a
        query may attend to a key. A finite minimum keeps fully masked rows (padding
        queries) NaN-free.
      dtype: of the probabilities and the output.
      dropout: applied to the probabilities (training), if given.

    Returns:
      [batch, q_len, kv_heads, group, head_dim] in ``dtype``.
    """
    # Heads first, before the products: the scores' gradient then contracts with q over
    # (group, q_len), adjacent in both, so XLA:CPU hands it to its matmul as it is.
    # With q as [b, q, h, g, d] it transposed the float32 [b, h, g, q, k] gradient
    # instead, every layer, with the group innermost (1.17 -> 0.82 ms forward and
    # backward a layer at the 2M decoder's shapes on one core); q, k and v are
    # [length, head_dim] a head, the scores [length, length].
    q = q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)
    q, k = q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3)
    scores = jnp.einsum("bhgqd,bhkd->bhgqk", q, k, preferred_element_type=jnp.float32)
    if mask is not None:
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    if dropout is not None:
        probs = dropout(probs)
    out = jnp.einsum("bhgqk,bhkd->bhgqd", probs, v.astype(dtype).transpose(0, 2, 1, 3))
    return out.transpose(0, 3, 1, 2, 4)
