"""The collectives of trainer/parallel/collectives.py against what they stand for,
computed on whole arrays with no collective: jnp.take on the whole table, and its
gradient; the shards' bits, concatenated by numpy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tpu_devices
from jax.sharding import PartitionSpec as P

from trainer.analysis import hlo
from trainer.parallel import collectives
from trainer.parallel import mesh as mesh_lib
from trainer.parallel.layout import LeafLayout


@pytest.mark.parametrize(
    "group, vocab, pad, bits",
    [
        (0, 64, 0, False),
        (0, 61, 3, True),  # padded rows: never looked up, zero gradient
        (4, 40, 0, True),  # partial sharding (2 replicas of 4): summed over the replicas
    ],
)
def test_sharded_lookup_equals_take_on_the_whole_table(group, vocab, pad, bits):
    features, dtype = 16, jnp.float32
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1}, shard_group_size=group)
    data = mesh_lib.data_axes(mesh)
    n, partial = mesh.shape["data"], mesh.shape.get("replica", 1) > 1
    lay = LeafLayout((vocab, features), ((), ()), sharded=True, start=0, stop=1, pad=pad)
    assert collectives.lookup_eligible(lay, n)
    rng = np.random.default_rng(0)
    table = rng.normal(size=(vocab, features)).astype(np.float32)
    # 8 replicas' rows of 5 tokens; ids repeat within and across replicas.
    ids = rng.integers(0, vocab, size=(8, 2, 5)).astype(np.int32)
    cotangent = jnp.asarray(rng.normal(size=(8, 2, 5, features)), jnp.bfloat16)
    lookup = collectives.sharded_lookup(
        lay, n, dtype, jnp.bfloat16, jnp.float32, partial, bits=bits
    )

    def per_replica(shard, ids, cotangent):
        rows, vjp = jax.vjp(lambda s: lookup(s, ids[0]), shard)
        return rows[None], vjp(cotangent[0])[0]

    stored = np.concatenate([table, np.zeros((pad, features), np.float32)])
    rows, grad = jax.jit(
        jax.shard_map(
            per_replica,
            mesh=mesh,
            in_specs=(P("data"), P(data), P(data)),
            out_specs=(P(data), P("data")),
            check_vma=False,
        )
    )(stored, ids, cotangent)

    whole = jnp.asarray(table).astype(jnp.bfloat16)  # the rows travel in gather_dtype
    np.testing.assert_array_equal(np.asarray(rows), np.asarray(whole[ids]))
    assert rows.dtype == jnp.bfloat16
    # The gradient: every replica's cotangents summed into the rows of their ids.
    want = np.zeros((vocab + pad, features), np.float64)
    np.add.at(want, ids.reshape(-1), np.asarray(cotangent, np.float64).reshape(-1, features))
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6, atol=1e-6)
    assert not np.asarray(grad)[vocab:].any()


# Each collective that moves bits: its name in the HLO -> (a function of (x, bits), the
# output's spec). Both give back the [24, 16] array they were handed, moved.
MOVES = {
    "all-gather": (lambda x, bits: collectives.all_gather(x, 0, bits=bits)[None], P("data")),
    "all-to-all": (lambda x, bits: collectives.all_to_all(x, 1, 0, bits=bits), P(None, "data")),
}


@pytest.mark.parametrize("kind", sorted(MOVES))
def test_bf16_is_moved_as_its_bits_on_cpu_and_as_a_float_on_tpu(kind):
    move, out_spec = MOVES[kind]
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1})
    assert collectives.gathers_bits(mesh)
    # Every kind of bf16 value a collective must carry as it is: signed zeros,
    # subnormals, infinities and a NaN with a payload.
    bits = np.random.default_rng(0).integers(0, 2**16, size=(24, 16), dtype=np.uint16)
    bits[0, :6] = [0x0000, 0x8000, 0x0001, 0x7F80, 0xFF80, 0x7FC1]
    x = jax.lax.bitcast_convert_type(jnp.asarray(bits), jnp.bfloat16)

    def moved(bits_on):
        return jax.jit(
            jax.shard_map(
                lambda v: move(v, bits_on),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=out_spec,
                check_vma=False,
            )
        )

    out = np.asarray(jax.lax.bitcast_convert_type(moved(True)(x), jnp.uint16))
    want = np.broadcast_to(bits, (8, 24, 16)) if kind == "all-gather" else bits
    np.testing.assert_array_equal(out, want)

    def collectives_run(program):  # the element type of each such collective XLA:CPU runs
        text = program.lower(x).compile().as_text()
        return [c.dtype for c in hlo.collectives(text, 8) if c.kind == kind]

    # What the bits avoid (jaxlib 0.12.0.1): XLA:CPU moves bf16 in f32. When this fails,
    # XLA:CPU moves bf16 as it is, and gathers_bits can go.
    assert collectives_run(moved(False)) == ["f32"]
    assert collectives_run(moved(True)) == ["u16"]
    # A TPU compiles the float's collectives as they are.
    tpu = mesh_lib.make_mesh({"data": -1}, devices=tpu_devices("v5e:2x2"))
    assert not collectives.gathers_bits(tpu)


@pytest.mark.parametrize("rings", [(2, 4), (4, 2), (2, 2, 2)])
def test_a_reduce_scatter_ring_by_ring_keeps_each_devices_block(rings):
    """collectives.reduce_scatter over the data axis taken as rings (the slowest first):
    device d ends with block d of the sum over every device, as one psum_scatter
    gives, and its gradient through collectives.gather is that sum too; a block of
    fewer than 8 rows (a TPU tile's, which libtpu cannot scatter ring by ring) in one
    reduce-scatter."""
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1})
    rng = np.random.default_rng(0)

    def scatter(rows):
        return jax.jit(
            jax.shard_map(
                lambda v: collectives.reduce_scatter(v[0], 0, rings)[None],
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )
        )

    for rows, steps in ((64, sorted(rings)), (32, [8])):  # 8 rows a device, then 4
        x = rng.normal(size=(8, rows, 3)).astype(np.float32)  # each device's [rows, 3]
        np.testing.assert_allclose(
            np.asarray(scatter(rows)(x)).reshape(rows, 3), x.sum(0), rtol=1e-6, atol=1e-6
        )
        # One reduce-scatter a ring, each within groups of that ring's size.
        text = scatter(rows).lower(x).compile().as_text()
        sizes = [c.group_size for c in hlo.collectives(text, 8) if c.kind == "reduce-scatter"]
        assert sorted(sizes) == steps

    lay = LeafLayout((64, 3), ((), ()), sharded=True, start=0, stop=1)
    gather = collectives.gather(lay, jnp.float32, jnp.float32, jnp.float32, False, rings=rings)
    cotangent = rng.normal(size=(8, 64, 3)).astype(np.float32)  # each replica's

    def grad(shard, ct):
        return jax.vjp(gather, shard)[1](ct[0])[0]

    got = jax.jit(
        jax.shard_map(
            grad, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False
        )
    )(np.zeros((64, 3), np.float32), cotangent)
    np.testing.assert_allclose(np.asarray(got), cotangent.sum(0), rtol=1e-6, atol=1e-6)


def test_a_reduce_scatter_ring_by_ring_stays_within_each_replica_group():
    """Ring by ring with another mesh axis beside ``data`` (``replica``: the slices of a
    multislice run, whose data axis is each a whole slice): the groups index ``data``
    alone, so each replica's devices sum only their own gradients."""
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1}, shard_group_size=4)
    assert dict(mesh.shape) == {"replica": 2, "data": 4, "model": 1}
    x = np.random.default_rng(1).normal(size=(2, 4, 32, 3)).astype(np.float32)
    scattered = jax.jit(
        jax.shard_map(
            lambda v: collectives.reduce_scatter(v[0, 0], 0, (2, 2))[None, None],
            mesh=mesh,
            in_specs=P("replica", "data"),
            out_specs=P("replica", "data"),
            check_vma=False,
        )
    )
    out = np.asarray(scattered(x))
    for r in range(2):
        np.testing.assert_allclose(out[r].reshape(32, 3), x[r].sum(0), rtol=1e-6, atol=1e-6)
