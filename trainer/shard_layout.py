"""How one parameter is stored for a sharded update ("data formatting").

Xu et al. 2020, section 4.1: to shard a tensor N ways, use a dimension that
divides by N; otherwise merge adjacent dimensions and pad the merged one with
zeros. Merging before padding keeps the padding small. Dimensions already
sharded over another mesh axis (model parallelism) are left alone.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from trainer import mesh as mesh_lib


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter is stored for its update.

    Logical dims ``[start, stop)`` are merged into one stored dimension, padded
    with ``pad`` zeros, and that dimension is sharded over ``data``.

    Attributes:
      shape: logical shape.
      spec: mesh spec of the logical array (model axes only), one entry per dim.
      sharded: whether the update is sharded over ``data``.
      start: first merged logical dim (= the sharded stored dim).
      stop: one past the last merged logical dim.
      pad: zeros appended to the merged dimension.
    """

    shape: tuple[int, ...]
    spec: tuple
    sharded: bool = False
    start: int = 0
    stop: int = 0
    pad: int = 0

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if not self.sharded:
            return self.shape
        merged = math.prod(self.shape[self.start : self.stop]) + self.pad
        return self.shape[: self.start] + (merged,) + self.shape[self.stop :]

    def stored_spec(self, *, gathered: bool = False) -> PartitionSpec:
        """Spec of the stored array (``gathered``: with ``data`` dropped)."""
        if not self.sharded:
            return PartitionSpec(*self.spec)
        data = None if gathered else mesh_lib.DATA_AXIS
        return PartitionSpec(*self.spec[: self.start], data, *self.spec[self.stop :])

    def describe(self) -> str:
        """One line for the sharding plan table."""
        if not self.sharded:
            return "replicated"
        merged = "x".join(str(d) for d in self.shape[self.start : self.stop])
        how = f"dim {self.start}" if self.stop - self.start == 1 else f"merged dims {merged}"
        return f"{how} -> {self.stored_shape} over data, pad {self.pad}"

    def to_stored(self, x: jax.Array, batch_dims: int = 0) -> jax.Array:
        """Logical -> stored: merge dims, pad with zeros (after ``batch_dims``)."""
        if not self.sharded:
            return x
        lead = x.shape[:batch_dims]
        merged_len = math.prod(self.shape[self.start : self.stop])
        x = x.reshape(lead + self.shape[: self.start] + (merged_len,) + self.shape[self.stop :])
        if self.pad:
            widths = [(0, 0)] * x.ndim
            widths[batch_dims + self.start] = (0, self.pad)
            x = jnp.pad(x, widths)
        return x

    def to_logical(self, x: jax.Array) -> jax.Array:
        """Stored -> logical: drop the padding, split the merged dim."""
        if not self.sharded:
            return x
        merged_len = math.prod(self.shape[self.start : self.stop])
        x = jax.lax.slice_in_dim(x, 0, merged_len, axis=self.start)
        return x.reshape(self.shape)


def choose_layout(
    shape: tuple[int, ...], spec: PartitionSpec, num_shards: int, min_shard_bytes: int
) -> LeafLayout:
    """Picks the cheapest way to shard one f32 parameter ``num_shards`` ways.

    Among runs of adjacent dims not already sharded over another mesh axis, the
    run whose merged size needs the fewest padded elements wins; ties prefer a
    single dim (no reshape), then the earliest. Parameters under
    ``min_shard_bytes`` or with fewer elements than shards stay replicated: the
    collective latency would cost more than the update it saves.
    """
    spec_t = tuple(spec) + (None,) * (len(shape) - len(spec))
    layout = LeafLayout(shape=tuple(shape), spec=spec_t)
    size = math.prod(shape)
    if num_shards == 1 or size * 4 < min_shard_bytes or size < num_shards:
        return layout
    best = None
    for start in range(len(shape)):
        for stop in range(start + 1, len(shape) + 1):
            if spec_t[stop - 1] is not None:
                break
            merged = math.prod(shape[start:stop])
            pad = -merged % num_shards
            key = (pad * (size // merged), stop - start, start)
            if best is None or key < best[0]:
                best = (key, start, stop, pad)
    if best is None:
        return layout
    _, start, stop, pad = best
    return dataclasses.replace(layout, sharded=True, start=start, stop=stop, pad=pad)
