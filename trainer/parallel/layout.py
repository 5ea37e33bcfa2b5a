"""How one parameter is stored for a sharded update ("data formatting").

Xu et al. 2020, section 4.1: a tensor is sharded N ways on a dimension that
divides by N, after cheap reformatting where none does: merge *leading*
dimensions (a reshape that moves no data), pad the major dimension with zeros
rather than merge minor ones. The shard of every replica is then one
contiguous block of the tensor, which both the reduce-scatter and the
all-gather move as it lies (on TPU a gather on a minor dimension is emitted as
an all-reduce of a zero-filled buffer: twice the bytes).

The choice, in order of preference (section 3.2: shard only where profitable):

1. contiguous: the leading run of dims ``[0, k)`` (never including the minor
   dim of a matrix: merging it would relayout the tiled tensor), merged and
   padded; the ``k`` with the least padding wins, then the shortest merge;
2. ``data`` joins a dim that ``model`` already splits, where that needs no
   padding (model parallelism, MLPerf multipod paper section 3.2);
3. strided: any other free dim, or run of free dims short of the minor one,
   with the least padding, the most major first.

A run may also take in the minor dim when that dim is a multiple of 128, by
splitting it into ``(minor / 128, 128)`` and merging only the first part
(paper 4.1's TPU bitcast: ``[3,3,256,256]`` as ``[576,8,128]``): the 128-wide
lanes of the tiled layout stay whole, so this too moves no data. Among equal
padding, layouts without the split win.

A layout whose padding exceeds ``max_padding`` (a fraction of the tensor) is
not a candidate, and parameters whose per-device bytes (their own dtype, after
model sharding) are under ``min_shard_bytes`` stay replicated: there the
collective's latency costs more than the update it saves. Mesh axes of size 1
do not count as sharding a dim.

The stored tensor keeps the logical rank: a merged run ``[s, e)`` becomes
size-1 dims followed by the merged dim (``[3,3,256,256]`` -> ``[1,1,2304,256]``),
so code that looks at ``ndim`` (optax masks, say) sees what it would see on the
logical tensor. The leading 1s cost nothing in a tiled layout as long as the
collectives drop them (:mod:`trainer.parallel.plan` does): the TPU back end
runs a reduce-scatter on a dim with only size-1 dims before it as an all-reduce.

Padding a major dim to whole (8, 128) tiles per shard is left to the TPU back
end: its fused reduce-scatter pads a shard of 500 rows itself (plus two
collective-permutes), which costs less than a padded stored layout (padding the
``[32000, 1024]`` embedding to 504 rows a shard took 250 MiB more HBM per core
and 0.4 ms more compute on v3:32x32, libtpu 0.0.42.1). Shards under 8 rows, or
of an odd number of tiles, it runs as an all-reduce: ``min_shard_bytes`` keeps
such small tensors replicated.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from trainer.parallel import mesh as mesh_lib

Axes = tuple[str, ...]
# Width of the minor dim of a TPU tile: splitting a multiple of it off the minor
# dim is a bitcast, not a relayout.
_LANES = 128


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one parameter is stored for its update.

    Logical dims ``[start, stop)`` are merged into stored dim ``stop - 1`` (the
    dims before it become size 1), padded with ``pad`` zeros, and that dim is
    sharded over ``data`` (after the model axes already on it, if any).

    Attributes:
      shape: logical shape.
      spec: model-parallel mesh axes of each logical dim (a tuple of axis names,
        empty for none; axes of size 1 dropped).
      sharded: whether the update is sharded over ``data``.
      start: first merged logical dim.
      stop: one past the last merged logical dim.
      pad: zeros appended to the merged dimension.
      lanes: 0, or 128 when the run includes the minor dim: it is stored as
        ``(merged / lanes, lanes)`` and the first of the two is sharded.
      reason: why the parameter is replicated ("" when sharded).
    """

    shape: tuple[int, ...]
    spec: tuple[Axes, ...]
    sharded: bool = False
    start: int = 0
    stop: int = 0
    pad: int = 0
    lanes: int = 0
    reason: str = ""

    @property
    def dim(self) -> int:
        """The stored dim that is sharded over ``data``."""
        return self.stop - 2 if self.lanes else self.stop - 1

    @property
    def _rows(self) -> int:
        """Size of the merged dim before padding."""
        return math.prod(self.shape[self.start : self.stop]) // max(self.lanes, 1)

    def _run_shape(self) -> tuple[int, ...]:
        """Stored dims in place of logical dims ``[start, stop)`` (as many)."""
        tail = (self._rows + self.pad,) + ((self.lanes,) if self.lanes else ())
        return (1,) * (self.stop - self.start - len(tail)) + tail

    @property
    def stored_shape(self) -> tuple[int, ...]:
        if not self.sharded:
            return self.shape
        return self.shape[: self.start] + self._run_shape() + self.shape[self.stop :]

    @property
    def reformatted(self) -> bool:
        """Whether the stored tensor differs from the logical one (merged or padded)."""
        return self.sharded and (self.pad > 0 or self.stop - self.start > 1)

    @property
    def padding(self) -> float:
        """Padded elements as a fraction of the logical size."""
        return self.pad / self._rows if self.sharded else 0.0

    def stored_spec(self, *, gathered: bool = False) -> PartitionSpec:
        """Spec of the stored array (``gathered``: with ``data`` dropped)."""
        entries = [_entry(axes) for axes in self.spec]
        if self.sharded:
            data = () if gathered else (mesh_lib.DATA_AXIS,)
            # Merged dims are free of model axes; a single dim may carry some.
            entries[self.start : self.stop] = [None] * (self.stop - self.start)
            entries[self.dim] = _entry(
                self.spec[self.start] + data if self.stop - self.start == 1 else data
            )
        return PartitionSpec(*entries)

    def logical_spec(self) -> PartitionSpec:
        """Spec of the logical array: its model axes only."""
        return PartitionSpec(*(_entry(axes) for axes in self.spec))

    def describe(self) -> str:
        """One line for the sharding plan table."""
        if not self.sharded:
            return f"replicated ({self.reason})"
        if self.stop - self.start > 1:
            merged = "x".join(str(d) for d in self.shape[self.start : self.stop])
            how = f"merged dims {merged}" + (f" in rows of {self.lanes}" if self.lanes else "")
        elif self.spec[self.dim]:
            how = f"dim {self.dim} (with {'+'.join(self.spec[self.dim])})"
        else:
            how = f"dim {self.dim}"
        return f"{how} -> {self.stored_shape} over data, pad {self.pad} ({self.padding:.1%})"

    def model_apart(self, axis_sizes: Mapping[str, int]) -> LeafLayout:
        """This layout with its sharded dim taken apart where ``data`` joins model
        axes on it: ``[..., rows, ...]`` as ``[..., rows / m, m, ...]``, ``data``
        alone on the first, the model axes (``m`` ways) on the second
        (:func:`apart`, :func:`joined`); itself elsewhere.

        The same bytes on the same devices: each device's block is contiguous in
        both (the joined dim is split model-major, and on a device the model dim is
        1 long, so the swap moves nothing). But a ``shard_map`` manual over the data
        axes alone can name this split, where it would read the joined dim as split
        data-major and have the partitioner move the whole tensor to match; and
        ``data``'s dim comes before the model's, so a reduce-scatter on it is one on
        the major dim.
        """
        model = self.spec[self.dim] if self.sharded and self.stop - self.start == 1 else ()
        if not model:
            return self
        m = math.prod(axis_sizes[a] for a in model)
        d = self.dim
        return dataclasses.replace(
            self,
            shape=self.shape[:d] + (self.shape[d] // m, m) + self.shape[d + 1 :],
            spec=self.spec[:d] + ((), model) + self.spec[d + 1 :],
        )

    def in_layer(self) -> LeafLayout:
        """The layout of one layer's slice of this stack of layers (dim 0 dropped):
        a stack laid out with ``first=1`` stores each layer's slice alike."""
        if self.sharded and self.start < 1:
            raise ValueError(f"a layout of {self.shape} that merges its layers dim")
        start, stop = max(self.start - 1, 0), max(self.stop - 1, 0)
        return dataclasses.replace(
            self, shape=self.shape[1:], spec=self.spec[1:], start=start, stop=stop
        )

    # -- A stack of layers (logical dim 0 = layers) seen a layer at a time in the stored
    # -- layout: what per-tensor rules (trust ratios) need, with no gather of the tensor.

    def _layer_rows(self) -> int | None:
        """Rows of stored dim :attr:`dim` per layer where the layers dim is merged or
        padded into it; None where stored dim 0 is still the layers dim."""
        if not self.reformatted or self.start >= 1:
            return None
        return self._rows // self.shape[0]

    def layer_sums(self, x: jax.Array) -> jax.Array:
        """Per-layer sums ``[layers]`` of ``x``, this stack in its stored form.

        Where stored dim 0 is the layers dim, a sum over the other dims; where the
        layout merged it with the dims after it, each stored row lies in one layer
        (the merge is row-major and a layer holds whole rows, lanes included), so the
        row sums are summed by layer, padding rows dropped. Under GSPMD every shard sums
        its own rows and the ``[layers]`` partial sums are all-reduced.
        """
        per_layer = self._layer_rows()
        if per_layer is None:
            return jnp.sum(x, axis=tuple(range(1, x.ndim)))
        rows = jnp.sum(x, axis=tuple(i for i in range(x.ndim) if i != self.dim))
        layer = jnp.arange(rows.shape[0]) // per_layer  # padding rows: layer >= layers
        return jax.ops.segment_sum(rows, layer, self.shape[0], indices_are_sorted=True)

    def layer_broadcast(self, v: jax.Array, x: jax.Array) -> jax.Array:
        """``v`` (``[layers]``) laid out to multiply ``x``, this stack in its stored
        form, elementwise: each element by its layer's value (padding by 0)."""
        per_layer = self._layer_rows()
        if per_layer is None:
            return v.reshape(v.shape + (1,) * (x.ndim - 1))
        layer = jnp.arange(x.shape[self.dim]) // per_layer
        per_row = jnp.take(v, layer, mode="fill", fill_value=0)
        return per_row.reshape(tuple(-1 if i == self.dim else 1 for i in range(x.ndim)))

    def to_stored(self, x: jax.Array, batch_dims: int = 0) -> jax.Array:
        """Logical -> stored: merge dims, pad with zeros (after ``batch_dims``).

        Works on a whole tensor or on a shard of it whose split dims are not the
        merged ones (sizes outside the merged run are taken from ``x``).
        """
        if not self.reformatted:
            return x
        b = batch_dims
        run = self._run_shape()
        run = run[: self.dim - self.start] + (self._rows,) + run[self.dim - self.start + 1 :]
        x = x.reshape(x.shape[: b + self.start] + run + x.shape[b + self.stop :])
        if self.pad:
            widths = [(0, 0)] * x.ndim
            widths[b + self.dim] = (0, self.pad)
            x = jnp.pad(x, widths)
        return x

    def to_logical(self, x: jax.Array, batch_dims: int = 0) -> jax.Array:
        """Stored -> logical: drop the padding, split the merged dim (whole tensor
        or shard, as for :meth:`to_stored`)."""
        if not self.reformatted:
            return x
        b = batch_dims
        x = jax.lax.slice_in_dim(x, 0, self._rows, axis=b + self.dim)
        merged = self.shape[self.start : self.stop]
        return x.reshape(x.shape[: b + self.start] + merged + x.shape[b + self.stop :])


def apart(x: jax.Array, dim: int, m: int) -> jax.Array:
    """Dim ``dim`` of ``x`` as two, ``[rows / m, m]``, taken model-major
    (:meth:`LeafLayout.model_apart`)."""
    x = x.reshape(x.shape[:dim] + (m, x.shape[dim] // m) + x.shape[dim + 1 :])
    return jnp.swapaxes(x, dim, dim + 1)


def joined(x: jax.Array, dim: int) -> jax.Array:
    """Dims ``dim`` and ``dim + 1`` of ``x``, taken apart by :func:`apart`, as one."""
    x = jnp.swapaxes(x, dim, dim + 1)
    return x.reshape(x.shape[:dim] + (-1,) + x.shape[dim + 2 :])


def _entry(axes: Axes):
    """PartitionSpec entry for a dim split over ``axes``."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def effective_spec(
    spec: PartitionSpec, ndim: int, axis_sizes: Mapping[str, int]
) -> tuple[Axes, ...]:
    """Per-dim mesh axes of ``spec``, without the axes of size 1."""
    out = []
    for entry in tuple(spec) + (None,) * (ndim - len(spec)):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        out.append(tuple(a for a in axes if axis_sizes.get(a, 1) > 1))
    return tuple(out)


def choose_layout(
    shape: tuple[int, ...],
    spec: PartitionSpec,
    num_shards: int,
    *,
    axis_sizes: Mapping[str, int],
    itemsize: int = 4,
    min_shard_bytes: int = 0,
    max_padding: float = 0.25,
    first: int = 0,
) -> LeafLayout:
    """Picks how to shard one parameter ``num_shards`` ways (see the module doc).

    Args:
      shape: logical shape.
      spec: its model-parallel PartitionSpec.
      num_shards: size of the ``data`` axis the update is sharded over.
      axis_sizes: sizes of the mesh axes (to tell real model sharding from size 1).
      itemsize: bytes per element of the parameter.
      min_shard_bytes: per-device bytes (after model sharding) under which the
        parameter stays replicated.
      max_padding: the largest padding, as a fraction of the tensor, a layout may add.
      first: the first dim a layout may shard or merge: 1 for a stack of layers
        gathered a layer at a time (each layer's slice is then sharded alike).
    """
    shape = tuple(shape)
    axes = effective_spec(spec, len(shape), axis_sizes)
    layout = LeafLayout(shape=shape, spec=axes)
    model_split = [math.prod(axis_sizes[a] for a in dim_axes) for dim_axes in axes]
    per_device = math.prod(shape) * itemsize / math.prod(model_split)
    if num_shards == 1:
        return dataclasses.replace(layout, reason="one shard")
    if not shape:
        return dataclasses.replace(layout, reason="scalar")
    if per_device < min_shard_bytes:
        return dataclasses.replace(layout, reason=f"{per_device:.0f} B < min_shard_bytes")

    def run(start: int, stop: int, lanes: int = 0) -> LeafLayout | None:
        rows = math.prod(shape[start:stop]) // max(lanes, 1)
        pad = -rows % num_shards
        if pad > max_padding * rows:
            return None
        return dataclasses.replace(
            layout, sharded=True, start=start, stop=stop, pad=pad, lanes=lanes
        )

    def least_padding(candidates: list[LeafLayout | None]) -> LeafLayout | None:
        # Least padding, then no lane split, then the shortest merge, the most major.
        found = [c for c in candidates if c is not None]
        key = lambda c: (c.padding, c.lanes, c.stop - c.start, c.start)  # noqa: E731
        return min(found, key=key, default=None)

    n = len(shape)
    free = [not a for a in axes]
    # A merged run takes in the minor dim of a matrix only in whole rows of 128
    # lanes; any other merge of it would relayout the tiled tensor.
    last_merge = n - 1 if n > 1 else 1
    split = _LANES if n > 1 and shape[-1] % _LANES == 0 else 0

    def with_lanes(start: int) -> list[LeafLayout | None]:
        return [run(start, n, split)] if split and n - start >= 2 and all(free[start:]) else []

    leading = [
        run(first, k) for k in range(first + 1, last_merge + 1) if all(free[first:k])
    ] + with_lanes(first)
    if best := least_padding(leading):
        return best
    for d, split in enumerate(model_split):
        if d >= first and split > 1 and shape[d] % (split * num_shards) == 0:
            return dataclasses.replace(layout, sharded=True, start=d, stop=d + 1)
    strided = [
        run(s, e)
        for s in range(first + 1, len(shape))
        for e in range(s + 1, len(shape) + 1)
        if all(free[s:e]) and (e == s + 1 or e <= last_merge)
    ] + [c for s in range(first + 1, n) for c in with_lanes(s)]
    if best := least_padding(strided):
        return best
    return dataclasses.replace(layout, reason=f"no layout pads under {max_padding:.0%}")
