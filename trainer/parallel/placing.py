"""Parameters placed straight into a plan's stored, sharded layout from host data, a
device's block at a time: a checkpoint that is read a tensor at a time (Hugging
Face's safetensors) never becomes a whole model on the host, nor a replicated one on
the devices.

A leaf comes as a function of the layer (``source(i)``: layer ``i`` of a stack of
layers, in its logical shape without the layers dim) or whole (``source(None)``).
Each device's block of the stored array (:class:`~trainer.parallel.layout.LeafLayout`:
leading dims merged, the major dim padded and split over ``data``) is cut out of
the layers it covers: a stack's merged rows run layer after layer, so a block needs
only its own layers. Devices with the same block (replicas) share one host copy.
Other layouts of a stack (a split that is not the stack's leading run) are built
from the whole leaf, which the layout rules make rare.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from trainer.parallel.layout import LeafLayout

Source = Callable[[int | None], np.ndarray]


def _stored(layout: LeafLayout, logical: np.ndarray) -> np.ndarray:
    """A whole leaf in its stored layout (numpy: merged dims, padded)."""
    if not layout.reformatted:
        return logical
    run = list(layout.stored_shape[layout.start : layout.stop])
    run[layout.dim - layout.start] -= layout.pad
    x = logical.reshape(logical.shape[: layout.start] + tuple(run) + logical.shape[layout.stop :])
    widths = [(0, 0)] * x.ndim
    widths[layout.dim] = (0, layout.pad)
    return np.pad(x, widths)


def _rows_block(layout: LeafLayout, index: tuple[slice, ...], source: Source, dtype) -> np.ndarray:
    """The block ``index`` of a stack whose stored layout merges its leading run:
    merged rows [a, b) of ``layout.dim``, the layers they fall in read one by one."""
    shape = layout.stored_shape
    rows_per_layer = math.prod(layout.shape[1 : layout.stop]) // max(layout.lanes, 1)
    total = rows_per_layer * layout.shape[0]
    rows = index[layout.dim]
    a, b = rows.start or 0, shape[layout.dim] if rows.stop is None else rows.stop
    rest = index[layout.dim + 1 :]
    block_shape = [len(range(*s.indices(n))) for s, n in zip(index, shape, strict=True)]
    block = np.zeros(block_shape, dtype)
    lead = (0,) * layout.dim  # the size-1 dims before the merged one
    for layer in range(a // rows_per_layer, min(b, total) // rows_per_layer + 1):
        first, last = layer * rows_per_layer, (layer + 1) * rows_per_layer
        lo, hi = max(a, first), min(b, last, total)
        if lo >= hi:
            continue
        flat = source(layer).astype(dtype, copy=False)
        flat = flat.reshape((rows_per_layer,) + tuple(shape[layout.dim + 1 :]))
        block[lead + (slice(lo - a, hi - a),)] = flat[(slice(lo - first, hi - first), *rest)]
    return block


def place(
    layout: LeafLayout, sharding: NamedSharding, dtype, source: Source, *, stacked: bool
) -> jax.Array:
    """The leaf of ``layout`` in its stored shape and ``sharding``, from ``source``.

    Args:
      layout: the leaf's layout in the plan (logical shape ``[layers, ...]`` if stacked).
      sharding: the stored array's sharding (``plan.stored_shardings()``'s leaf).
      dtype: the stored dtype (the master weights').
      source: ``source(i)`` -> layer ``i`` if ``stacked``, else ``source(None)`` -> the
        leaf; numpy arrays in the logical shape, any dtype.
      stacked: whether the leaf is a stack of layers.
    """
    shape = layout.stored_shape
    by_rows = stacked and layout.sharded and layout.start == 0 and layout.reformatted
    whole = None
    blocks: dict[tuple, np.ndarray] = {}
    arrays = []
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n) for s, n in zip(index, shape, strict=True))
        if key not in blocks:
            if by_rows:
                blocks[key] = _rows_block(layout, index, source, dtype)
            elif stacked and not layout.reformatted:
                # Stored as it is, [layers, ...]: each layer's part of the block.
                layers = range(*index[0].indices(shape[0]))
                blocks[key] = np.stack(
                    [source(i).astype(dtype, copy=False)[index[1:]] for i in layers]
                )
            else:
                if whole is None:
                    logical = (
                        np.stack([source(i) for i in range(layout.shape[0])])
                        if stacked
                        else source(None)
                    )
                    whole = _stored(layout, logical.astype(dtype, copy=False))
                blocks[key] = np.ascontiguousarray(whole[index])
        arrays.append(jax.device_put(blocks[key], device))
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
