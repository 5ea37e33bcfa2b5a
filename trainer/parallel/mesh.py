"""Device mesh from the config.

The config names the mesh axes and their sizes, e.g. ``{"data": -1, "model": 1}``
(-1 = "all devices the other axes leave"), per slice. With several slices joined
by the data-center network (TPU multislice: ``device.slice_index``) the ``dcn``
sizes say how many slices each axis spans; each slice's devices are laid out as a
single slice's would be, and the slices are stacked as the outer factor of those
axes, so only the outermost part of an axis crosses the slow links. Off TPU each
process stands in for a slice (a host of GPUs joined to the others by its network;
on CPU, ``launch.local``'s processes), chosen by the same ``dcn`` config.

Weight-update sharding can shard within groups of G data replicas (partial
sharding, Xu et al. 2020, section 5.2). The mesh then splits its ``data`` axis
into ``replica`` (D / G, across groups) x ``data`` (G, within a group): batches
shard over both, optimizer state only over the inner one. A group never spans
slices: G is at most a slice's share of ``data``, and ``replica`` runs across the
groups of a slice first, then across slices (MLPerf multipod paper, section 3.3:
the slow dimension carries only what the fast one has reduced).

On TPU devices the mesh follows the torus (:func:`trainer.parallel.torus.device_grid`):
the innermost axes take the cores and neighbouring chips, so a group of
``data`` is whole torus dimensions, a closed ring where the slice wraps around
(a row of a v3 pod for groups of 64), and ``replica`` runs across the rows.
Other devices keep JAX's order (``mesh_utils.create_device_mesh``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from trainer.errors import ConfigError
from trainer.parallel import torus

DATA_AXIS = "data"
REPLICA_AXIS = "replica"


class MeshError(ConfigError):
    """The requested mesh does not fit the devices."""


def resolve_axis_sizes(axes: Mapping[str, int], num_devices: int) -> dict[str, int]:
    """Replaces the single -1 in ``axes`` by what the other sizes leave.

    Args:
      axes: ordered mapping of axis name to size; at most one size may be -1.
      num_devices: the number of devices the mesh must cover exactly.

    Returns:
      The same axes with concrete sizes.

    Raises:
      MeshError: with the numbers, when the sizes cannot cover the devices.
    """
    sizes = dict(axes)
    wildcards = [name for name, size in sizes.items() if size == -1]
    if len(wildcards) > 1:
        raise MeshError(f"mesh: only one axis may be -1, got {wildcards}")
    bad = [f"{n}={s}" for n, s in sizes.items() if s != -1 and s < 1]
    if bad:
        raise MeshError(f"mesh: axis sizes must be positive or -1, got {', '.join(bad)}")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if wildcards:
        if num_devices % fixed:
            raise MeshError(
                f"mesh: {num_devices} devices are not divisible by the product {fixed} "
                f"of the fixed axes {dict(axes)}"
            )
        sizes[wildcards[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshError(
            f"mesh: axes {dict(axes)} multiply to {fixed} devices, but {num_devices} "
            f"devices are available"
        )
    return sizes


def split_data_axis(sizes: Mapping[str, int], shard_group_size: int) -> dict[str, int]:
    """Splits ``data`` into ``replica`` x ``data`` for partial update sharding.

    Args:
      sizes: resolved axis sizes containing ``data``.
      shard_group_size: G, the most data replicas sharing one update; 0, or G at
        least the data size, means a single group (no split), so a config tuned
        for a pod still runs on a few devices.

    Returns:
      Axis sizes with ``replica`` inserted before ``data``.
    """
    data = sizes[DATA_AXIS]
    group = min(shard_group_size, data) if shard_group_size else data
    if data % group:
        raise MeshError(
            f"optimizer.shard_group_size={shard_group_size} does not divide the data "
            f"axis size {data}"
        )
    out: dict[str, int] = {}
    for name, size in sizes.items():
        if name == DATA_AXIS:
            out[REPLICA_AXIS] = data // group
            out[DATA_AXIS] = group
        else:
            out[name] = size
    return out


def slices(devices: Sequence[jax.Device], wanted: int) -> list[list[jax.Device]]:
    """``devices`` grouped by slice, in slice order: TPU devices by ``slice_index``;
    other devices, when ``wanted`` > 1, by process (each process a slice).

    Raises:
      MeshError: the devices do not form ``wanted`` slices of equal size.
    """

    def grouped(key) -> list[list[jax.Device]]:
        out: dict[int, list[jax.Device]] = {}
        for d in devices:
            out.setdefault(key(d), []).append(d)
        return [out[k] for k in sorted(out)]

    found = grouped(lambda d: getattr(d, "slice_index", 0))
    how = "slice(s)"
    if len(found) == 1 and wanted > 1 and devices[0].platform != "tpu":
        found, how = grouped(lambda d: d.process_index), "process(es), one per slice"
    if len(found) != wanted:
        raise MeshError(
            f"mesh: dcn axes multiply to {wanted} slices, but the devices form {len(found)} {how}"
        )
    if len({len(s) for s in found}) > 1:
        raise MeshError(f"mesh: slices of unequal sizes {[len(s) for s in found]}")
    return found


def make_mesh(
    axes: Mapping[str, int],
    dcn_axes: Mapping[str, int] | None = None,
    *,
    shard_group_size: int = 0,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the device mesh (all axes ``Auto``, for GSPMD constraints).

    Args:
      axes: per-slice (ICI) axis sizes; one may be -1.
      dcn_axes: how many slices each axis spans (product = number of slices);
        None or all ones for a single slice.
      shard_group_size: see :func:`split_data_axis`; within a slice.
      devices: devices to use (default: all).

    Returns:
      A mesh whose axes are ``replica`` (if present), then the config's axes.
    """
    devices = list(jax.devices() if devices is None else devices)
    grid, names = device_array(axes, dcn_axes, shard_group_size, devices)
    return Mesh(grid, names, axis_types=(AxisType.Auto,) * len(names))


def device_array(
    axes: Mapping[str, int],
    dcn_axes: Mapping[str, int] | None,
    shard_group_size: int,
    devices: Sequence[jax.Device],
) -> tuple[np.ndarray, tuple[str, ...]]:
    """The devices of :func:`make_mesh` as an array, and its axis names."""
    if DATA_AXIS not in axes:
        raise MeshError(f"mesh: the axes {dict(axes)} must include '{DATA_AXIS}'")
    dcn = {name: 1 for name in axes} | dict(dcn_axes or {})
    if set(dcn) != set(axes):
        raise MeshError(f"mesh: dcn axes {sorted(dcn)} must match mesh axes {sorted(axes)}")
    if any(n < 1 for n in dcn.values()):
        raise MeshError(f"mesh: dcn axis sizes must be >= 1, got {dcn}")
    groups = slices(devices, math.prod(dcn.values()))
    ici = split_data_axis(resolve_axis_sizes(axes, len(groups[0])), shard_group_size)
    # The slices are the outer factor of the axes that span them; the data axis's
    # goes to ``replica``: a group stays inside its slice.
    spans = {name: dcn.get(name, 1) for name in ici} | {
        REPLICA_AXIS: dcn[DATA_AXIS],
        DATA_AXIS: 1,
    }
    names = tuple(ici)
    per_slice = tuple(ici.values())
    grid = np.empty(tuple(ici[n] * spans[n] for n in names), dtype=object)
    for position, slice_devices in zip(np.ndindex(*(spans[n] for n in names)), groups, strict=True):
        block = tuple(slice(p * n, (p + 1) * n) for p, n in zip(position, per_slice, strict=True))
        grid[block] = _slice_grid(slice_devices, per_slice)
    return grid, names


def _slice_grid(devices: Sequence[jax.Device], shape: tuple[int, ...]) -> np.ndarray:
    """One slice's devices as an array of ``shape``: on the torus for TPU devices
    (:func:`trainer.parallel.torus.device_grid`), in JAX's order otherwise."""
    grid = torus.device_grid(devices, shape)
    if grid is None:
        grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    return np.asarray(grid, dtype=object)


def describe_groups(mesh: Mesh, num_slices: int = 1) -> str:
    """Where the mesh's update-sharding groups (its ``data`` axis) sit, e.g.
    ``group = torus row x, 32 chips x 2 cores, wraps; 32 groups along y``; with
    ``num_slices`` > 1 (the config's ``dcn`` axes), within one slice, and how many."""
    axis = mesh.axis_names.index(DATA_AXIS)
    devices = list(mesh.devices.flat)
    if num_slices == 1:
        return torus.describe_groups(mesh.devices, axis, devices)

    first = slices(devices, num_slices)[0]
    members = set(first)
    rows = np.moveaxis(mesh.devices, axis, -1)
    rows = rows.reshape(-1, rows.shape[-1])
    in_slice = np.asarray([row for row in rows if row[0] in members])
    text = torus.describe_groups(in_slice, 1, first)
    what = "slices" if devices[0].platform == "tpu" else "processes standing in for slices"
    return f"{text}; in each of {num_slices} {what} (DCN between them)"


def data_rings(mesh: Mesh) -> tuple[int, ...]:
    """The torus rings a group of the ``data`` axis spans, fastest first, where it is a
    whole slice of two dimensions or more, each closed into a ring
    (:func:`trainer.parallel.torus.rings`): the steps
    :func:`trainer.parallel.collectives.reduce_scatter` takes. () elsewhere, and off
    TPU."""
    axis = mesh.axis_names.index(DATA_AXIS)
    group = list(np.moveaxis(mesh.devices, axis, -1).reshape(-1, mesh.shape[DATA_AXIS])[0])
    where = getattr(group[0], "slice_index", 0)
    one_slice = [d for d in mesh.devices.flat if getattr(d, "slice_index", 0) == where]
    return torus.rings(group, one_slice)


def data_axes(mesh: Mesh) -> tuple[str, ...]:
    """The mesh axes a batch is split over: ``replica`` (if any) and ``data``."""
    return tuple(a for a in (REPLICA_AXIS, DATA_AXIS) if a in mesh.axis_names)


def data_parallel_size(mesh: Mesh) -> int:
    """Number of data-parallel replicas: the product of the batch axes."""
    return math.prod(mesh.shape[a] for a in data_axes(mesh))
