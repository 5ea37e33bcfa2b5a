"""Rotary position embeddings (Su et al. 2021), in the rotate-half form.

A head's ``d`` channels are two halves ``[x1 | x2]``; channel pair ``(i, i + d/2)`` is
rotated by ``position * inv_freq[i]``. That is the layout of Hugging Face's Llama,
Mistral and Qwen2 checkpoints (whose conversion from Meta's interleaved pairs
``(2i, 2i+1)`` permuted the rows of the query and key weights once, so that this
form computes what the original does), so their weights load here unpermuted. The
rotation is relative: a query at ``p`` and a key at ``p'`` interact through
``p - p'`` alone, which is why packed documents may restart their positions at 0.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's frequency scaling of a RoPE trained at ``original_context`` tokens
    for longer contexts: wavelengths longer than ``original_context / low_freq_factor``
    are stretched by ``factor``, shorter than ``original_context / high_freq_factor``
    kept, and those between interpolated smoothly."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_context: int = 8192


def inverse_frequencies(
    head_dim: int, theta: float, scaling: Llama3Scaling | None = None
) -> np.ndarray:
    """float32 [head_dim // 2]: the rotation rate of each channel pair."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq.astype(np.float32)
    low_wavelength = scaling.original_context / scaling.low_freq_factor
    high_wavelength = scaling.original_context / scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    scaled = np.where(wavelength > low_wavelength, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_context / wavelength - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """``x`` [batch, length, ..., head_dim] rotated by int [batch, length] positions;
    the angles in float32, the result in ``x``'s dtype."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [b, l, d/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[-1:])
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
