"""Where TPU devices sit: chips on a torus, cores on a chip, and shard groups on its rings.

A TPU slice is a 2-D (v2, v3, v5e, v6e) or 3-D (v4, v5p) grid of chips, each
joined by ICI links to its neighbours. A dimension closes into a ring through
wrap-around links only where the slice spans it whole: on v2/v3/v5e/v6e a
dimension as long as the pod's (v3: 32 chips), on v4/v5p any slice made of
whole 4x4x4 cubes. Without the wrap-around a dimension is a line, and a ring
along it must come back the way it went.

Xu et al. 2020 (section 5.2, Fig. 10) place each group of replicas that shares
an update (``optimizer.shard_group_size``) on a ring of the torus, a row of the
v3 pod: its reduce-scatters and all-gathers run around a closed ring, and the
all-reduce across groups runs along the other dimension. :func:`device_grid`
does that for any mesh: devices in physical order (core, then x, then y, then
z, fastest first) are cut into the mesh's axes, innermost axis first. With the
trainer's axes (``replica``, ``data``, ``model``) a model axis takes the cores
of a chip and its neighbours, each group of ``data`` the next whole torus
dimensions (a row of 32 chips x 2 cores of a v3 pod for groups of 64), and
``replica`` the rest. A group that is not whole dimensions is a block of rows,
or a line: :func:`describe_group` says which.

Devices per chip come from the devices themselves (how many share a chip's
coordinates): two TensorCores are two devices on v2/v3; v4 and v5p run them as
one ("megacore"), v5e and v6e have one.

Sources: pod shapes and which slices wrap around, "How to Scale Your Model"
(jax-ml.github.io/scaling-book), part 2 "How to Think About TPUs", section
"TPU Networking" (v3 pods 32x32; v5e/v6e 16x16, wrapping along any axis of
16; v4/v5p wrap-around on slices of whole 4x4x4 cubes); v2 pods of 256 chips:
Kumar et al. 2021, "Exploring the limits of concurrency in ML training on
Google TPUs" (shared/seeds/tpu-multipod-mlperf-paper.txt), section 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Generation:
    """The torus of one TPU generation.

    Attributes:
      name: ``v3``, ``v5p``, ... (the row name in :mod:`trainer.parallel.hardware`).
      dims: 2 or 3 torus dimensions.
      pod_shape: chips along each dimension of a whole pod; a dimension of a
        slice wraps around when it is the pod's whole dimension. Empty for the
        generations whose slices of whole 4x4x4 cubes wrap in every dimension.
    """

    name: str
    dims: int
    pod_shape: tuple[int, ...] = ()

    def wraps(self, shape: Sequence[int]) -> tuple[bool, ...]:
        """Per dimension of a slice of ``shape`` chips, whether it closes into a ring."""
        if self.pod_shape:
            return tuple(s == p and s > 2 for s, p in zip(shape, self.pod_shape, strict=False))
        cubes = all(s % 4 == 0 for s in shape)
        return tuple(cubes for _ in shape)


_V2 = Generation("v2", 2, (16, 16))
_V3 = Generation("v3", 2, (32, 32))
_V4 = Generation("v4", 3)
_V5E = Generation("v5e", 2, (16, 16))
_V5P = Generation("v5p", 3)
_V6E = Generation("v6e", 2, (16, 16))
# jax.Device.device_kind -> generation (libtpu's topologies report "TPU v5" for v5p).
_KINDS = {
    "TPU v2": _V2,
    "TPU v3": _V3,
    "TPU v4": _V4,
    "TPU v5 lite": _V5E,
    "TPU v5e": _V5E,
    "TPU v5p": _V5P,
    "TPU v5": _V5P,
    "TPU v6 lite": _V6E,
    "TPU v6e": _V6E,
}
GENERATIONS = {g.name: g for g in _KINDS.values()}


def generation(device_kind: str) -> Generation | None:
    """The TPU generation of a ``jax.Device.device_kind`` (None: not a TPU we know)."""
    return _KINDS.get(device_kind)


@dataclasses.dataclass(frozen=True)
class Torus:
    """The chips a set of TPU devices occupies.

    Attributes:
      generation: the TPU generation.
      origin: coordinates of the lowest chip.
      shape: chips along each torus dimension.
      cores_per_chip: devices on each chip.
      wraps: per dimension, whether the slice closes it into a ring.
    """

    generation: Generation
    origin: tuple[int, ...]
    shape: tuple[int, ...]
    cores_per_chip: int
    wraps: tuple[bool, ...]

    @classmethod
    def of(cls, devices: Sequence) -> Torus | None:
        """The torus of ``devices``, or None if they are not TPU devices filling a box
        of chips (CPU and GPU devices, a ragged subset of a slice)."""
        first = devices[0]
        gen = generation(getattr(first, "device_kind", ""))
        if gen is None or getattr(first, "coords", None) is None:
            return None
        chips = [tuple(d.coords[: gen.dims]) for d in devices]
        origin = tuple(min(c[i] for c in chips) for i in range(gen.dims))
        shape = tuple(max(c[i] for c in chips) - origin[i] + 1 for i in range(gen.dims))
        distinct = set(chips)
        if len(distinct) != math.prod(shape) or len(devices) % len(distinct):
            return None
        return cls(gen, origin, shape, len(devices) // len(distinct), gen.wraps(shape))

    def chip(self, device) -> tuple[int, ...]:
        """The chip of ``device``, relative to the slice's origin."""
        return tuple(c - o for c, o in zip(device.coords, self.origin, strict=False))


def _physical_key(device, torus: Torus) -> tuple:
    """Sorts devices slowest first: slice, z, y, x, then the core on the chip."""
    chip = torus.chip(device)
    return (getattr(device, "slice_index", 0), *reversed(chip), getattr(device, "core_on_chip", 0))


def device_grid(devices: Sequence, shape: Sequence[int]) -> np.ndarray | None:
    """``devices`` as an array of ``shape`` in physical order (see the module
    docstring), or None if they are not TPU devices on a box of chips.

    Args:
      devices: the mesh's devices, in any order.
      shape: the mesh's axis sizes, outermost first (product = len(devices)).
    """
    torus = Torus.of(devices)
    if torus is None:
        return None
    ordered = sorted(devices, key=lambda d: _physical_key(d, torus))
    return np.asarray(ordered, dtype=object).reshape(tuple(shape))


_DIM_NAMES = "xyz"


def describe_groups(grid: np.ndarray, group_axis: int, slice_devices: Sequence) -> str:
    """Where the groups along axis ``group_axis`` of a device grid sit on the slice
    of ``slice_devices``: the torus dimensions a group spans, its chips and cores,
    whether it closes into a ring, and along what the groups repeat.

    Returns:
      e.g. ``group = torus row x, 32 chips x 2 cores, wraps; 32 groups along y``,
      or a plain sentence for devices without a torus.
    """
    first = list(np.moveaxis(grid, group_axis, -1).reshape(-1, grid.shape[group_axis])[0])
    groups = grid.size // len(first)
    many = f"{groups} group{'s' if groups > 1 else ''}"
    slice_torus, torus = Torus.of(slice_devices), Torus.of(first)
    if slice_torus is None or torus is None:
        platform = getattr(first[0], "platform", "?")
        return f"group = {len(first)} {platform} devices in device order (no torus); {many}"
    spans, extents = torus.shape, slice_torus.shape
    whole = [i for i, (s, e) in enumerate(zip(spans, extents, strict=True)) if s == e > 1]
    partial = [i for i, (s, e) in enumerate(zip(spans, extents, strict=True)) if 1 < s < e]
    cores = torus.cores_per_chip
    size = f"{math.prod(spans)} chips x {cores} core{'s' if cores > 1 else ''}"
    names = "-".join(_DIM_NAMES[i] for i in whole)
    if not whole and not partial:
        where = f"one chip, {cores} core{'s' if cores > 1 else ''}"
    elif not partial and len(whole) == sum(e > 1 for e in extents):
        where = f"the whole slice ({'x'.join(map(str, extents))}), {size}"
    elif not partial:
        where = f"torus {'row' if len(whole) == 1 else 'plane'} {names}, {size}"
    elif not whole and len(partial) == 1:
        d = partial[0]
        where = f"part of torus row {_DIM_NAMES[d]} ({spans[d]} of {extents[d]} chips), {size}"
    elif len(partial) == 1:
        d = partial[0]
        kind = "rows" if len(whole) == 1 else "planes"
        where = f"{spans[d]} torus {kind} {names} side by side along {_DIM_NAMES[d]}, {size}"
    else:
        where = f"a block of {'x'.join(map(str, spans))} chips, {size}"
    if not whole:
        closure = "a line (part of a dimension: no wrap-around)"
    elif all(slice_torus.wraps[i] for i in whole):
        closure = "wraps"
    else:
        closure = "no wrap-around (the slice does not span the pod's dimension: a line)"
    across = "-".join(
        _DIM_NAMES[i] for i, (s, e) in enumerate(zip(spans, extents, strict=True)) if s < e
    )
    return f"group = {where}, {closure}; {many}" + (f" along {across}" if groups > 1 else "")


def rings(group: Sequence, slice_devices: Sequence) -> tuple[int, ...]:
    """The torus rings a collective over ``group`` (devices in their mesh order) can
    run along one after another, fastest first: one per dimension of chips the group
    spans (the cores of a chip joined to the first), where ``group`` is the whole
    slice of ``slice_devices`` in physical order, of two dimensions or more, each
    closed into a ring by wrap-around links; () otherwise (one dimension, part of a
    slice, a dimension that is a line, no torus).

    Why: libtpu lowers a reduce-scatter over a whole slice (v2 to v5p; v5e from 4x4
    chips, not 2x2) to an all-reduce of the whole buffer and a slice, twice the bytes
    of the reduce-scatter asked for; scattered one ring after another, each step stays
    a true reduce-scatter (docs/aot.md, "per_layer's gradient"), run both ways round
    where the ring closes. Along a line it must come back the way it went, and on
    v5e:4x8 the one all-reduce was the cheaper (a tiny model's collectives, 0.2%).
    """
    torus = Torus.of(group)
    if torus is None or set(group) != set(slice_devices):
        return ()
    if list(group) != sorted(group, key=lambda d: _physical_key(d, torus)):
        return ()
    spanned = [(e, w) for e, w in zip(torus.shape, torus.wraps, strict=True) if e > 1]
    if len(spanned) < 2 or not all(w for _, w in spanned):
        return ()
    extents = [e for e, _ in spanned]
    extents[0] *= torus.cores_per_chip
    return tuple(extents)


def ring_group_sizes(devices: Sequence) -> list[int]:
    """Group sizes (devices) that :func:`device_grid` places on whole torus
    dimensions of ``devices``' slice, or on two of them side by side: a row, two
    rows, a plane, two planes, ..., the whole slice. [] off TPU."""
    torus = Torus.of(devices)
    if torus is None:
        return []
    sizes, size = [], torus.cores_per_chip
    for extent in torus.shape:
        if extent > 2 and sizes:
            sizes.append(2 * size)  # two rows (planes) side by side
        size *= extent
        if extent > 1:
            sizes.append(size)
    return sizes
