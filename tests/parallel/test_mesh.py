"""Mesh construction from config sizes, on 8 simulated CPU devices."""

import jax
import pytest

from trainer.parallel import mesh as mesh_lib


def test_wildcard_takes_the_remaining_devices():
    mesh = mesh_lib.make_mesh({"data": -1, "model": 2})
    assert dict(mesh.shape) == {"replica": 1, "data": 4, "model": 2}
    assert mesh_lib.data_axes(mesh) == ("replica", "data")
    assert mesh_lib.data_parallel_size(mesh) == 4
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_partial_sharding_splits_the_data_axis():
    mesh = mesh_lib.make_mesh({"data": -1, "model": 1}, shard_group_size=2)
    assert dict(mesh.shape) == {"replica": 4, "data": 2, "model": 1}
    assert mesh_lib.data_parallel_size(mesh) == 8


@pytest.mark.parametrize(
    "axes, message",
    [
        ({"data": 3, "model": 2}, "multiply to 6 devices, but 8 devices"),
        ({"data": -1, "model": 3}, "8 devices are not divisible by the product 3"),
        ({"data": -1, "model": -1}, "only one axis may be -1"),
        ({"model": 8}, "must include 'data'"),
    ],
)
def test_mismatch_errors_give_the_numbers(axes, message):
    with pytest.raises(mesh_lib.MeshError, match=message):
        mesh_lib.make_mesh(axes)


def test_group_size_must_divide_data():
    with pytest.raises(mesh_lib.MeshError, match="shard_group_size=3 does not divide"):
        mesh_lib.make_mesh({"data": -1}, shard_group_size=3)


def test_group_larger_than_data_is_one_group():
    # configs/transformer_1024.py asks for groups of 64 (a pod); 8 devices are one group.
    mesh = mesh_lib.make_mesh({"data": -1}, shard_group_size=64)
    assert dict(mesh.shape) == {"replica": 1, "data": 8}


def test_dcn_must_match_slices():
    with pytest.raises(mesh_lib.MeshError, match="multiply to 2 slices, but the devices form 1"):
        mesh_lib.make_mesh({"data": -1}, {"data": 2})
