"""The collectives of weight-update sharding over the ``data`` mesh axis, inside a
``shard_map``: the all-gather of a stored shard, the reduce-scatter of a gradient into
it, a parameter's gather whose VJP is that reduce-scatter, and the lookup of a token
table's rows that leaves the table sharded.

:mod:`trainer.parallel.plan` gathers and reduces every parameter with them, and
:mod:`trainer.parallel.layer_gather` each layer of a stack inside its scan.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from trainer.parallel import mesh as mesh_lib
from trainer.parallel.layout import LeafLayout


def gathers_bits(mesh: Mesh) -> bool:
    """Whether :func:`all_gather` and :func:`all_to_all` on ``mesh`` move a 16-bit
    float's bits (their ``bits``): on CPU devices.

    XLA:CPU runs an all-gather of bf16 in f32 (jaxlib 0.12.0.1): it converts every
    shard up, gathers twice the bytes and converts the whole result back down, two
    passes over the gathered weights; an all-to-all alike. uint16 it moves as it is.
    These collectives do no arithmetic, so moving the bits is exact. Other back ends
    move bf16 as it is, and get the float.
    """
    return np.asarray(mesh.devices).flat[0].platform == "cpu"


def _as_bits(x: jax.Array, bits: bool) -> bool:
    """Whether a collective moves ``x`` as its bits: where ``bits``, a 16-bit float."""
    return bits and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2


def all_gather(x: jax.Array, dim: int, *, bits: bool = False) -> jax.Array:
    """The shards of ``x`` over ``data``, concatenated on ``dim``; a 16-bit float's
    as its bits where ``bits`` (:func:`gathers_bits`)."""
    if not _as_bits(x, bits):
        return jax.lax.all_gather(x, mesh_lib.DATA_AXIS, axis=dim, tiled=True)
    gathered = all_gather(jax.lax.bitcast_convert_type(x, jnp.uint16), dim)
    # Materialised on its own: XLA:CPU emits a transpose fused with a bitcast-convert as
    # a scalar loop (the 64M decoder's output table: 339 ms a step, against 75 ms for
    # the transpose of bf16 and 56 ms for the convert from f32 before it).
    return jax.lax.optimization_barrier(jax.lax.bitcast_convert_type(gathered, x.dtype))


def all_to_all(x: jax.Array, split: int, concat: int, *, bits: bool = False) -> jax.Array:
    """``x`` cut into as many blocks on ``split`` as ``data`` has devices, block ``i``
    sent to device ``i``, and the blocks received concatenated on ``concat``; a 16-bit
    float's as its bits where ``bits`` (XLA:CPU runs a bf16 all-to-all in f32 too)."""
    if not _as_bits(x, bits):
        return jax.lax.all_to_all(
            x, mesh_lib.DATA_AXIS, split_axis=split, concat_axis=concat, tiled=True
        )
    traded = all_to_all(jax.lax.bitcast_convert_type(x, jnp.uint16), split, concat)
    # No barrier here: what reads a trade (the lookup's take, the gradient's sum) fuses
    # the bitcast back well, and a barrier made the 64M lookup slower than f32's (94
    # against 90 ms forward and backward, 79 without it: the lookup of
    # scripts/collective_bits.py, with a third variant behind a barrier, 7 rounds).
    return jax.lax.bitcast_convert_type(traded, x.dtype)


# The rows of a TPU tile (8, 128). libtpu 0.0.52 refuses a reduce-scatter within a ring
# that leaves a device fewer ("AllReduceScatterFusion not implemented for 2nd-minor
# compaction": the tiny LM's d-512 weights over v5e:8x16, 4 rows a device); 20 rows
# (the 16B's d 5120 over 256 chips) compile. Its all-reduce has no such limit.
_TILE_ROWS = 8


def reduce_scatter(x: jax.Array, dim: int, rings: tuple[int, ...] = ()) -> jax.Array:
    """``x`` summed over ``data``, this device's block of ``dim`` kept.

    With ``rings`` (:func:`trainer.parallel.mesh.data_rings`: the sizes of the torus
    rings ``data`` spans, fastest first; why, :func:`trainer.parallel.torus.rings`) it
    is summed along one ring after another, the slowest first, each a reduce-scatter
    within the groups of ``data`` that differ only along that ring: device ``d`` still
    keeps block ``d``.
    """
    n = math.prod(rings)
    if len(rings) < 2 or x.shape[dim] // n < _TILE_ROWS:
        return jax.lax.psum_scatter(x, mesh_lib.DATA_AXIS, scatter_dimension=dim, tiled=True)
    index = np.arange(n).reshape(rings[::-1])  # slowest ring first
    for ring in range(len(rings)):
        groups = np.moveaxis(index, ring, -1).reshape(-1, index.shape[ring]).tolist()
        x = jax.lax.psum_scatter(
            x, mesh_lib.DATA_AXIS, scatter_dimension=dim, axis_index_groups=groups, tiled=True
        )
    return x


def on_major_dim(collective, x: jax.Array, dim: int) -> jax.Array:
    """``collective(x, dim)``, with the size-1 dims before ``dim`` dropped around it
    when there are only such (a stored layout keeps its logical rank:
    ``[3,3,256,256]`` is stored ``[1,1,2304,256]``).

    Dropping them is a bitcast, no copy; keeping them costs twice the bytes: the TPU
    back end runs a reduce-scatter whose scatter dim has only size-1 dims before it
    as an all-reduce plus a dynamic-slice, while the same tensor scattered on its
    major dim stays a true reduce-scatter (libtpu 0.0.42.1;
    tests/analysis/test_aot.py compiles for a v3 topology and checks).
    """
    lead = x.shape[:dim]
    if not lead or any(d != 1 for d in lead):  # already major, or a strided layout
        return collective(x, dim)
    out = collective(x.reshape(x.shape[dim:]), 0)
    return out.reshape(lead + out.shape)


def _per_model_shard(collective: Callable, lay: LeafLayout) -> Callable:
    """``collective`` (over the data axes) of a parameter stored as ``lay``, run on each
    model shard by itself where model axes split it: a ``shard_map`` manual over them.

    Inside a ``shard_map`` manual over the data axes alone, XLA's partitioner
    all-gathers a collective's operand over the model axes it is split on before the
    collective: every tensor-parallel weight would be gathered whole on each chip, and
    its f32 gradient too (tests/parallel/test_wus_step.py reads the program).
    """
    axes = {a for dim_axes in lay.spec for a in dim_axes}
    if not axes:
        return collective
    spec = lay.stored_spec(gathered=True)  # the model axes alone

    def run(x):
        mesh = jax.sharding.get_abstract_mesh()  # the enclosing shard_map's
        return jax.shard_map(
            collective, mesh=mesh, in_specs=spec, out_specs=spec, axis_names=axes, check_vma=False
        )(x)

    return run


def gather(
    lay: LeafLayout,
    dtype,
    gather_dtype,
    reduce_dtype,
    partial: bool,
    handed_low: bool = False,
    *,
    bits: bool = False,
    rings: tuple[int, ...] = (),
) -> Callable[[jax.Array], jax.Array]:
    """The local shard of a parameter stored as ``lay`` -> the whole parameter in its
    logical shape and ``dtype`` (``gather_dtype`` where ``handed_low``: see
    :attr:`~trainer.parallel.plan.UpdateShardingPlan.handed_low`), all-gathered in
    ``gather_dtype`` (as its bits where ``bits``: :func:`gathers_bits`); its gradient
    is reduce-scattered in ``reduce_dtype`` into the shard (ring by ring where
    ``rings``: :func:`reduce_scatter`; and summed over the ``replica`` axis where
    sharding is ``partial``), and comes back in ``dtype``."""
    gather_all = functools.partial(all_gather, bits=bits)
    gather_all = _per_model_shard(functools.partial(on_major_dim, gather_all, dim=lay.dim), lay)
    scatter = functools.partial(reduce_scatter, rings=rings)
    scatter = _per_model_shard(functools.partial(on_major_dim, scatter, dim=lay.dim), lay)

    @jax.custom_vjp
    def gathered(shard):
        whole = gather_all(shard.astype(gather_dtype))
        return lay.to_logical(whole).astype(gather_dtype if handed_low else dtype)

    def forward(shard):
        return gathered(shard), None

    def backward(_, grad):
        grad = scatter(lay.to_stored(grad).astype(reduce_dtype))
        if partial:
            grad = jax.lax.psum(grad, mesh_lib.REPLICA_AXIS)
        return (grad.astype(dtype),)

    gathered.defvjp(forward, backward)
    return gathered


def lookup_eligible(lay: LeafLayout, replicas: int) -> bool:
    """Whether :func:`sharded_lookup` can read a ``[vocab, features]`` table stored as
    ``lay``: its rows sharded over ``data`` (padded or not), no model axis, and
    ``features`` split evenly over the ``replicas`` devices of ``data``."""
    return (
        lay.sharded
        and len(lay.shape) == 2
        and (lay.start, lay.stop, lay.lanes) == (0, 1, 0)
        and not any(lay.spec)
        and lay.shape[1] % replicas == 0
    )


def sharded_lookup(
    lay: LeafLayout,
    replicas: int,
    dtype,
    gather_dtype,
    reduce_dtype,
    partial: bool,
    *,
    bits: bool = False,
) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """``(this device's shard of a table stored as lay, int ids) -> the ids' rows
    [*ids.shape, features]``, in ``gather_dtype``, with no gather of the table.

    Gathering a ``[vocab, features]`` table to look up a few thousand rows holds the
    whole table on every device (at 32,000 x 8,192 in bf16, 500 MiB a chip) and
    reduce-scatters a whole-table gradient. Here the devices of ``data`` trade the
    table's columns instead (:func:`all_to_all`, as bits where ``bits``: each ends
    with every row's ``features / n`` columns, ``1 / n`` of the table), look up every
    device's ids there, and trade the rows back, each device receiving its own ids'
    rows whole. The gradient goes the same way back: each device sums the cotangents
    of every device's ids into its columns in ``reduce_dtype`` (one sum over all the
    rows of the data axis, which is what the reduce-scatter of per-device sums would
    give), and the columns are traded back into the stored rows. Bytes moved a step
    are the rows' (``tokens x features``) and ``1 / n`` of the table, against the
    table's twice.

    Requires :func:`lookup_eligible` (``replicas``: the size of ``data``). Padding
    rows are never looked up; their gradient is zero. The gradient comes back in
    ``dtype``, the stored table's.
    """
    columns_shape = (lay.stored_shape[0], lay.shape[1] // replicas)

    def forward(shard, ids):
        columns = all_to_all(shard.astype(gather_dtype), 1, 0, bits=bits)  # [rows, features / n]
        every_id = jax.lax.all_gather(ids.reshape(-1), mesh_lib.DATA_AXIS, tiled=True)
        rows = jnp.take(columns, every_id, axis=0)  # [n * tokens, features / n]
        rows = all_to_all(rows, 0, 1, bits=bits)  # [tokens, features]
        return rows.reshape(*ids.shape, rows.shape[-1]), every_id

    @jax.custom_vjp
    def lookup(shard, ids):
        return forward(shard, ids)[0]

    def backward(every_id, grad):
        grad = grad.reshape(-1, grad.shape[-1])
        grad = all_to_all(grad, 1, 0, bits=bits)  # [n * tokens, features / n]
        summed = jnp.zeros(columns_shape, reduce_dtype).at[every_id].add(grad.astype(reduce_dtype))
        summed = all_to_all(summed, 0, 1, bits=bits)  # the stored rows, every column
        if partial:
            summed = jax.lax.psum(summed, mesh_lib.REPLICA_AXIS)
        return summed.astype(dtype), None

    lookup.defvjp(forward, backward)
    return lookup
