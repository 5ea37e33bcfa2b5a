"""The collectives of weight-update sharding over the ``data`` mesh axis, inside a
``shard_map``: the all-gather of a stored shard, the reduce-scatter of a gradient into
it, and a parameter's gather whose VJP is that reduce-scatter.

:mod:`trainer.parallel.plan` gathers and reduces every parameter with them, and
:mod:`trainer.parallel.layer_gather` each layer of a stack inside its scan.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from trainer.parallel import mesh as mesh_lib
from trainer.parallel.layout import LeafLayout


def all_gather(x: jax.Array, dim: int) -> jax.Array:
    """The shards of ``x`` over ``data``, concatenated on ``dim``."""
    return jax.lax.all_gather(x, mesh_lib.DATA_AXIS, axis=dim, tiled=True)


def reduce_scatter(x: jax.Array, dim: int) -> jax.Array:
    """``x`` summed over ``data``, this device's block of ``dim`` kept."""
    return jax.lax.psum_scatter(x, mesh_lib.DATA_AXIS, scatter_dimension=dim, tiled=True)


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


def gather(
    lay: LeafLayout, dtype, gather_dtype, reduce_dtype, partial: bool
) -> Callable[[jax.Array], jax.Array]:
    """The local shard of a parameter stored as ``lay`` -> the whole parameter in its
    logical shape and ``dtype``, all-gathered in ``gather_dtype``; its gradient is
    reduce-scattered in ``reduce_dtype`` into the shard (and summed over the
    ``replica`` axis where sharding is ``partial``)."""

    @jax.custom_vjp
    def gathered(shard):
        whole = on_major_dim(all_gather, shard.astype(gather_dtype), lay.dim)
        return lay.to_logical(whole).astype(dtype)

    def forward(shard):
        return gathered(shard), None

    def backward(_, grad):
        grad = lay.to_stored(grad).astype(reduce_dtype)
        grad = on_major_dim(reduce_scatter, grad, lay.dim)
        if partial:
            grad = jax.lax.psum(grad, mesh_lib.REPLICA_AXIS)
        return (grad.astype(dtype),)

    gathered.defvjp(forward, backward)
    return gathered
