"""Where TPU devices sit and where the mesh puts the update-sharding groups: fake
devices for the rules, libtpu's topologies (when installed) for the real thing."""

import dataclasses
import types

import numpy as np
import pytest
from conftest import tpu_devices

from trainer.parallel import mesh as mesh_lib
from trainer.parallel import torus


@dataclasses.dataclass(frozen=True)
class FakeTpu:
    """What placement reads of a ``jax.Device`` (a mesh needs it hashable)."""

    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    device_kind: str
    platform: str = "tpu"


def fake(x: int, y: int, z: int = 1, cores: int = 2, kind: str = "TPU v3"):
    """Devices of an x*y*z slice, shuffled: placement must not depend on their order."""
    chips = [(i, j, k) for k in range(z) for j in range(y) for i in range(x)]
    devices = [
        FakeTpu(n * cores + c, chip, c, kind) for n, chip in enumerate(chips) for c in range(cores)
    ]
    np.random.default_rng(0).shuffle(devices)
    return devices


def test_slices_wrap_where_real_slices_do():
    assert torus.Torus.of(fake(32, 32)).wraps == (True, True)  # a whole v3 pod
    assert torus.Torus.of(fake(4, 4)).wraps == (False, False)  # part of one
    assert torus.Torus.of(fake(32, 8)).wraps == (True, False)
    v5e = torus.Torus.of(fake(8, 16, cores=1, kind="TPU v5 lite"))
    assert v5e.wraps == (False, True) and v5e.cores_per_chip == 1
    cubes = torus.Torus.of(fake(4, 4, 8, cores=1, kind="TPU v5"))
    assert cubes.wraps == (True, True, True)  # whole 4x4x4 cubes
    assert torus.Torus.of(fake(2, 2, 1, cores=1, kind="TPU v4")).wraps == (False, False, False)
    cpu = [types.SimpleNamespace(platform="cpu", device_kind="cpu")]
    assert torus.Torus.of(cpu) is None
    ragged = fake(4, 4)[:-2]  # a chip with one core missing
    assert torus.Torus.of(ragged) is None


def test_groups_are_rows_of_the_pod_and_replicas_run_along_columns():
    devices = fake(32, 32)
    mesh = mesh_lib.make_mesh({"data": -1, "model": 1}, shard_group_size=64, devices=devices)
    assert dict(mesh.shape) == {"replica": 32, "data": 64, "model": 1}
    grid = mesh.devices[:, :, 0]
    for r, row in enumerate(grid):
        assert {d.coords[1] for d in row} == {r}  # one torus row per group
        # In ring order: x ascending, both cores of a chip side by side.
        assert [(d.coords[0], d.core_on_chip) for d in row] == [
            (i, c) for i in range(32) for c in range(2)
        ]
    assert mesh_lib.describe_groups(mesh) == (
        "group = torus row x, 32 chips x 2 cores, wraps; 32 groups along y"
    )


@pytest.mark.parametrize(
    "slice_, group, said",
    [
        ((32, 32, 1, 2), 128, "group = 2 torus rows x side by side along y, 64 chips x 2 cores"),
        ((32, 32, 1, 2), 2048, "group = the whole slice (32x32), 1024 chips x 2 cores, wraps"),
        ((4, 4, 1, 2), 8, "group = torus row x, 4 chips x 2 cores, no wrap-around"),
        ((4, 4, 1, 2), 4, "group = part of torus row x (2 of 4 chips), 2 chips x 2 cores, a line"),
        ((8, 8, 16, 1), 64, "group = torus plane x-y, 64 chips x 1 core, wraps; 16 groups along z"),
    ],
)
def test_where_a_group_sits_is_said(slice_, group, said):
    x, y, z, cores = slice_
    kind = "TPU v3" if cores == 2 else "TPU v5"
    devices = fake(x, y, z, cores, kind)
    mesh = mesh_lib.make_mesh({"data": -1}, shard_group_size=group, devices=devices)
    assert mesh_lib.describe_groups(mesh).startswith(said), mesh_lib.describe_groups(mesh)


def test_a_model_axis_takes_the_cores_of_a_chip():
    mesh = mesh_lib.make_mesh({"data": -1, "model": 2}, shard_group_size=32, devices=fake(32, 4))
    pairs = mesh.devices.reshape(-1, 2)
    assert all(a.coords == b.coords and a.core_on_chip != b.core_on_chip for a, b in pairs)
    assert mesh_lib.describe_groups(mesh).startswith("group = torus row x, 32 chips x 1 core")


def test_ring_group_sizes():
    assert torus.ring_group_sizes(fake(32, 32)) == [64, 128, 2048]
    assert torus.ring_group_sizes(fake(8, 8, 16, 1, "TPU v5")) == [8, 16, 64, 128, 1024]
    assert torus.ring_group_sizes([types.SimpleNamespace(platform="cpu", device_kind="cpu")]) == []


def test_cpu_devices_keep_their_order():
    mesh = mesh_lib.make_mesh({"data": -1}, shard_group_size=4)
    assert mesh_lib.describe_groups(mesh) == (
        "group = 4 cpu devices in device order (no torus); 2 groups"
    )
    assert mesh_lib.data_rings(mesh_lib.make_mesh({"data": -1})) == ()  # no torus, no rings


def test_libtpu_topologies_as_the_hardware_is():
    from trainer.analysis import compiled as compiled_lib

    pod = tpu_devices("v3:32x32")
    assert compiled_lib.topology_options("v3:32x32") == {"wrap": [1, 1, 0]}
    assert compiled_lib.topology_options("v3:4x4") == {"wrap": [0, 0, 0]}
    assert compiled_lib.topology_options("v5p:4x4x8_twisted") == {"wrap": [1, 1, 1]}
    assert torus.Torus.of(pod).cores_per_chip == 2 and len(pod) == 2048
    v4 = compiled_lib.topology_devices("v4:4x4x4")
    assert len(v4) == 64 and torus.Torus.of(v4).cores_per_chip == 1  # megacore, as JAX runs v4
    mesh = mesh_lib.make_mesh({"data": -1}, shard_group_size=64, devices=pod)
    assert mesh_lib.describe_groups(mesh).startswith("group = torus row x, 32 chips x 2 cores")


@dataclasses.dataclass(frozen=True)
class FakeSliceTpu(FakeTpu):
    """A TPU device of one of several slices (multislice)."""

    slice_index: int = 0


def _slices(count: int, x: int, y: int, cores: int = 2):
    """``count`` slices of x*y chips; coordinates restart in every slice, as libtpu's do."""
    out = []
    for s in range(count):
        for d in fake(x, y, cores=cores):
            out.append(
                FakeSliceTpu(
                    s * 1000 + d.id, d.coords, d.core_on_chip, d.device_kind, slice_index=s
                )
            )
    np.random.default_rng(1).shuffle(out)
    return out


def test_groups_stay_in_a_slice_on_its_rings_and_replicas_cross_slices_last():
    devices = _slices(2, 4, 4)  # two v3:4x4 slices, 32 cores each
    grid, names = mesh_lib.device_array({"data": -1}, {"data": 2}, 8, devices)
    assert names == ("replica", "data") and grid.shape == (8, 8)
    # Replicas 0-3 are the groups of slice 0, 4-7 those of slice 1: the slow links
    # come last.
    assert [{d.slice_index for d in row} for row in grid] == [{0}] * 4 + [{1}] * 4
    # Inside a slice, each group is a row of 4 chips x 2 cores, as on a lone slice.
    lone, _ = mesh_lib.device_array({"data": -1}, None, 8, fake(4, 4))
    for s in range(2):
        rows = grid[4 * s : 4 * s + 4]
        assert [[(d.coords, d.core_on_chip) for d in row] for row in rows] == [
            [(d.coords, d.core_on_chip) for d in row] for row in lone
        ]
    # No group spans slices: shard_group_size 0 (one group of the whole data axis)
    # means a slice's share of it.
    whole, _ = mesh_lib.device_array({"data": -1}, {"data": 2}, 0, devices)
    assert whole.shape == (2, 32)
    assert [{d.slice_index for d in row} for row in whole] == [{0}, {1}]


def test_libtpu_multislice_topologies_keep_groups_inside_slices():

    devices = tpu_devices("v5e:16x16", num_slices=2)
    assert len(devices) == 512 and {d.slice_index for d in devices} == {0, 1}
    mesh = mesh_lib.make_mesh({"data": -1}, {"data": 2}, shard_group_size=16, devices=devices)
    assert dict(mesh.shape) == {"replica": 32, "data": 16}
    for row in mesh.devices:
        assert len({d.slice_index for d in row}) == 1
    assert [row[0].slice_index for row in mesh.devices] == [0] * 16 + [1] * 16
    said = mesh_lib.describe_groups(mesh, num_slices=2)
    assert said.startswith("group = torus row ") and "wraps" in said
    assert said.endswith("in each of 2 slices (DCN between them)")


@pytest.mark.parametrize(
    "slice_, kind, axes, group, rings",
    [
        ((16, 16, 1, 1), "TPU v5 lite", {"data": -1}, 0, (16, 16)),  # a whole v5e-256
        ((32, 32, 1, 2), "TPU v3", {"data": -1}, 0, (64, 32)),  # the cores join x's ring
        ((4, 4, 4, 1), "TPU v5", {"data": -1}, 0, (4, 4, 4)),
        ((4, 8, 1, 1), "TPU v5 lite", {"data": -1}, 0, ()),  # lines, not rings: one step
        ((8, 16, 1, 1), "TPU v5 lite", {"data": -1}, 0, ()),  # x a line
        ((32, 32, 1, 2), "TPU v3", {"data": -1}, 64, ()),  # groups of a row: one ring
        ((16, 16, 1, 1), "TPU v5 lite", {"data": -1}, 128, ()),  # half the slice
        ((4, 4, 4, 1), "TPU v5", {"data": -1, "model": 4}, 0, ()),  # data: part of it
    ],
)
def test_the_data_axis_is_scattered_ring_by_ring_only_over_a_whole_slice(
    slice_, kind, axes, group, rings
):
    """mesh.data_rings: where a group of the data axis is a whole slice of two or more
    dimensions, each closed by wrap-around links, the sizes of its torus rings, fastest
    first; the devices of each ring differ only along that torus dimension."""
    x, y, z, cores = slice_
    mesh = mesh_lib.make_mesh(axes, shard_group_size=group, devices=fake(x, y, z, cores, kind))
    assert mesh_lib.data_rings(mesh) == rings
    if rings:
        line = list(mesh.devices.reshape(-1))
        # Data index d = i0 + r0 * (i1 + r1 * i2): device d and d + r0 differ in y alone.
        first, second = line[0], line[rings[0]]
        assert second.coords[0] == first.coords[0] and second.coords[1] == first.coords[1] + 1
        assert {d.coords[1] for d in line[: rings[0]]} == {0}  # the first ring: x (and cores)
