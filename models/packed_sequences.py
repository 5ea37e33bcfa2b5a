"""The parameter-free side of a Transformer's inputs, for rows that may pack several examples.

A packed row holds examples one after another, told apart by segment ids (1, 2, ...; 0 =
padding), with positions restarting at 0 in each (`trainer/input/packing.py` plans the rows).
So position embeddings come from those positions, decoder inputs are shifted within each
segment, and attention never crosses segments. Unpacked rows are the case without segment
ids.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def sinusoidal_embedding(positions: Array, dim: int) -> Array:
    """Sinusoidal position embeddings ([sin | cos] halves) of int [batch, length] positions.

    Computed from explicit positions so packed segments each restart at 0.
    Returns float32 [batch, length, dim].
    """
    # Vaswani et al.: channel pair i has wavelength 2*pi * 10000^(2i/dim).
    inv_freq = np.power(1.0e4, -2.0 * np.arange(dim // 2) / dim).astype(np.float32)
    angles = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


def shift_right(targets: Array, segmentation: Array | None = None) -> Array:
    """Decoder inputs: int [batch, length] targets shifted right by one, 0 (BOS) in front.

    With packing the first token of every segment is 0 rather than the previous segment's
    last token, so nothing leaks across segment boundaries.
    """
    shifted = jnp.pad(targets, ((0, 0), (1, 0)))[:, :-1]
    if segmentation is not None:
        previous_segment = jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1]
        shifted = jnp.where(segmentation == previous_segment, shifted, 0)
    return shifted


def attention_mask(
    q_valid: Array,
    k_valid: Array,
    q_seg: Array | None = None,
    k_seg: Array | None = None,
    causal: bool = False,
) -> Array:
    """Boolean [batch, 1, q_len, k_len] mask, True where a query may attend to a key."""
    mask = q_valid[:, :, None] & k_valid[:, None, :]
    if q_seg is not None:
        mask &= q_seg[:, :, None] == k_seg[:, None, :]
    if causal:
        q_len, k_len = mask.shape[1:]
        mask &= jnp.arange(q_len)[:, None] >= jnp.arange(k_len)[None, :]
    return mask[:, None]
