"""Weight-update sharding (Xu et al. 2020) as a layout plan and an optax transform.

In plain data parallelism every replica repeats the whole weight update. Here
each data replica owns one shard of every (large enough) parameter:

* the f32 master weights and the optimizer state are stored *sharded* over the
  ``data`` mesh axis, and stay sharded across the steps of the compiled loop;
* before the forward pass the weights are all-gathered in ``gather_dtype``
  (bf16: half the bytes of f32), cast on the shard before the collective;
* per-replica gradients are reduce-scattered (in ``reduce_dtype``, f32) into
  the same shard layout, and the inner optax optimizer updates only the shard.

Any shape can be sharded (paper section 4.1, "data formatting"): a dimension
that divides by the shard count is used as it is; otherwise adjacent free
dimensions are merged and the merged one is padded with zeros. Zero padding
never changes a result: padded gradients are zero, so Adam/SGD/LAMB/LARS
updates of padded entries stay zero, and the norms of LAMB/LARS trust ratios
are the norms of the real tensor. Dimensions already sharded over ``model``
keep that sharding and another dimension is sharded over ``data`` (MLPerf
multipod paper, section 3.2).

The three modes of ``optimizer.update_sharding`` are three plans over the same
code: ``none`` stores everything replicated (classic all-reduce), ``wus``
shards storage and gathers bf16 weights up front, ``fsdp`` shards storage and
hands the sharded f32 weights to the model so XLA gathers them per use.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer import mesh as mesh_lib
from trainer.errors import ConfigError
from trainer.shard_layout import LeafLayout, choose_layout

MODES = ("none", "wus", "fsdp")


def _is_layout(x) -> bool:
    return isinstance(x, LeafLayout)


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


@dataclasses.dataclass(frozen=True)
class UpdateShardingPlan:
    """Per-parameter layouts plus the collectives that move between them.

    Attributes:
      mesh: the device mesh (with ``data`` and possibly ``replica`` axes).
      mode: one of :data:`MODES`.
      layouts: a tree of :class:`LeafLayout`, shaped like the params.
      gather_dtype: dtype the weights are all-gathered in for the forward pass.
      reduce_dtype: dtype gradients are summed in.
    """

    mesh: Mesh
    mode: str
    layouts: Any
    gather_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = jnp.float32

    def _map(self, fn, *trees):
        return jax.tree.map(fn, self.layouts, *trees, is_leaf=_is_layout)

    def stored_shardings(self):
        """NamedShardings of the stored (master) params."""
        return self._map(lambda lay: NamedSharding(self.mesh, lay.stored_spec()))

    def abstract_stored(self, dtype=jnp.float32):
        """ShapeDtypeStructs of the stored params, with shardings."""
        return self._map(
            lambda lay: jax.ShapeDtypeStruct(
                lay.stored_shape, dtype, sharding=NamedSharding(self.mesh, lay.stored_spec())
            )
        )

    def to_stored(self, params):
        """Logical params -> stored layout, constrained to the stored shardings."""
        return self._map(
            lambda lay, x: jax.lax.with_sharding_constraint(
                lay.to_stored(x), NamedSharding(self.mesh, lay.stored_spec())
            ),
            params,
        )

    def to_logical(self, stored):
        """Stored params -> logical shapes (no cast)."""
        return self._map(lambda lay, x: lay.to_logical(x), stored)

    def gather(self, stored):
        """The weights the forward/backward pass sees.

        ``wus``: each shard is cast to ``gather_dtype`` and all-gathered in that
        dtype. ``none``: a local cast of the replicated weights. ``fsdp``: the
        sharded f32 weights, left for XLA to gather where they are used.
        """
        if self.mode == "fsdp":
            return self.to_logical(stored)
        dtype = self.gather_dtype

        def body(*leaves):
            out = []
            for lay, x in zip(flat_layouts, leaves, strict=True):
                x = x.astype(dtype)
                if lay.sharded:
                    x = jax.lax.all_gather(x, mesh_lib.DATA_AXIS, axis=lay.start, tiled=True)
                out.append(x)
            return tuple(out)

        flat_layouts, treedef = jax.tree.flatten(self.layouts, is_leaf=_is_layout)
        leaves = treedef.flatten_up_to(stored)
        gathered = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(lay.stored_spec() for lay in flat_layouts),
            out_specs=tuple(lay.stored_spec(gathered=True) for lay in flat_layouts),
            # A tiled all_gather's result is the same on every data replica, but
            # the varying-axes check cannot infer that.
            check_vma=False,
        )(*leaves)
        return self.to_logical(jax.tree.unflatten(treedef, gathered))

    def reduce(self, per_replica_grads):
        """Sums per-replica gradients into the stored layout.

        Args:
          per_replica_grads: tree of ``[num_replicas, *logical_shape]`` arrays,
            the leading dim sharded over the data axes (one row per replica).

        Returns:
          The summed gradients in ``reduce_dtype`` and the stored layout:
          reduce-scattered over ``data`` (then all-reduced over ``replica`` for
          partial sharding) for sharded leaves, all-reduced otherwise.
        """
        data_axes = mesh_lib.data_axes(self.mesh)
        flat_layouts, treedef = jax.tree.flatten(self.layouts, is_leaf=_is_layout)
        leaves = [
            lay.to_stored(g, batch_dims=1)
            for lay, g in zip(flat_layouts, treedef.flatten_up_to(per_replica_grads), strict=True)
        ]
        dtype = self.reduce_dtype

        def body(*leaves):
            out = []
            for lay, g in zip(flat_layouts, leaves, strict=True):
                g = g[0].astype(dtype)  # this replica's gradient
                if lay.sharded:
                    g = jax.lax.psum_scatter(
                        g, mesh_lib.DATA_AXIS, scatter_dimension=lay.start, tiled=True
                    )
                    if self.mesh.shape.get(mesh_lib.REPLICA_AXIS, 1) > 1:
                        g = jax.lax.psum(g, mesh_lib.REPLICA_AXIS)
                else:
                    g = jax.lax.psum(g, data_axes)
                out.append(g)
            return tuple(out)

        reduced = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(
                PartitionSpec(data_axes, *lay.stored_spec(gathered=True)) for lay in flat_layouts
            ),
            out_specs=tuple(lay.stored_spec() for lay in flat_layouts),
            # Without partial sharding the replica axis has size 1 and is not
            # reduced over (a psum there would still emit an all-reduce).
            check_vma=False,
        )(*leaves)
        return jax.tree.unflatten(treedef, reduced)

    def map_state(self, fn, other, state, *, logical: bool = False):
        """Maps ``fn(layout, leaf)`` over the param-shaped leaves of an optimizer
        state and ``other(leaf)`` over the rest (counts, scalars).

        A leaf is param-shaped when its path ends with a parameter's path and its
        shape is that parameter's stored shape (or logical shape, if
        ``logical``): Adam's ``mu``/``nu``, momentum, ... Matching by path works
        through ``optax.chain`` and ``optax.masked``.
        """
        by_path = {
            _path_key(path): lay
            for path, lay in jax.tree_util.tree_leaves_with_path(self.layouts, is_leaf=_is_layout)
        }
        depths = sorted({len(k) for k in by_path}, reverse=True)

        def one(path, leaf):
            key = _path_key(path)
            for depth in depths:
                lay = by_path.get(key[len(key) - depth :]) if depth <= len(key) else None
                shape = lay and (lay.shape if logical else lay.stored_shape)
                if lay is not None and tuple(leaf.shape) == shape:
                    return fn(lay, leaf)
            return other(leaf)

        return jax.tree_util.tree_map_with_path(one, state)

    def state_shardings(self, state):
        """Shardings for an optimizer state (arrays or ShapeDtypeStructs): param-
        shaped leaves follow their parameter's layout, the rest is replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return self.map_state(
            lambda lay, _: NamedSharding(self.mesh, lay.stored_spec()), lambda _: replicated, state
        )

    def logical_sharding(self, lay: LeafLayout) -> NamedSharding:
        """Sharding of a parameter in its logical shape, for checkpoints: the
        stored sharding where the layout only splits one dim, else model axes."""
        spec = lay.stored_spec() if lay.stored_shape == lay.shape else PartitionSpec(*lay.spec)
        return NamedSharding(self.mesh, spec)

    def state_to_logical(self, state):
        """Optimizer state in stored layout -> logical shapes (for checkpoints)."""
        return self.map_state(lambda lay, x: lay.to_logical(x), lambda x: x, state)

    def state_to_stored(self, state):
        """Optimizer state in logical shapes -> stored layout, constrained."""
        return self.map_state(
            lambda lay, x: jax.lax.with_sharding_constraint(
                lay.to_stored(x), NamedSharding(self.mesh, lay.stored_spec())
            ),
            lambda x: x,
            state,
            logical=True,
        )

    def logical_state_shardings(self, logical_state):
        """Shardings of an optimizer state in logical shapes."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return self.map_state(
            lambda lay, _: self.logical_sharding(lay), lambda _: replicated, logical_state,
            logical=True,
        )  # fmt: skip

    def table(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, logical shape, layout description) for every parameter."""
        return [
            ("/".join(_path_key(path)), lay.shape, lay.describe())
            for path, lay in jax.tree_util.tree_leaves_with_path(self.layouts, is_leaf=_is_layout)
        ]


def make_plan(
    abstract_params,
    param_specs,
    mesh: Mesh,
    *,
    mode: str = "wus",
    min_shard_bytes: int = 65536,
    gather_dtype=jnp.bfloat16,
    reduce_dtype=jnp.float32,
) -> UpdateShardingPlan:
    """Chooses a layout for every parameter.

    Args:
      abstract_params: tree of arrays or ShapeDtypeStructs (logical shapes).
      param_specs: matching tree of PartitionSpecs (model-parallel sharding).
      mesh: device mesh with a ``data`` axis.
      mode: ``none``, ``wus`` or ``fsdp``.
      min_shard_bytes: f32 parameters smaller than this stay replicated.
      gather_dtype: dtype of the weight all-gather (``wus``, ``none``).
      reduce_dtype: dtype of the gradient reduction.
    """
    if mode not in MODES:
        raise ConfigError(f"optimizer.update_sharding must be one of {MODES}, got '{mode}'")
    shards = mesh.shape[mesh_lib.DATA_AXIS] if mode != "none" else 1
    layouts = jax.tree.map(
        lambda p, s: choose_layout(tuple(p.shape), s, shards, min_shard_bytes),
        abstract_params,
        param_specs,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    return UpdateShardingPlan(mesh, mode, layouts, jnp.dtype(gather_dtype), jnp.dtype(reduce_dtype))


class WeightUpdateShardingState(NamedTuple):
    """State of :func:`weight_update_sharding`: the inner state, sharded."""

    inner_state: optax.OptState


def weight_update_sharding(
    inner: optax.GradientTransformation, plan: UpdateShardingPlan
) -> optax.GradientTransformation:
    """Wraps an optax optimizer so its update runs on this replica's shard only.

    ``init`` takes the master params in the plan's stored layout (see
    :meth:`UpdateShardingPlan.to_stored`); the inner state is created with the
    same layout. ``update`` takes *per-replica* gradients (``[replicas, ...]``,
    logical shapes), reduce-scatters them into the stored layout and runs the
    inner optimizer there; the returned updates are in the stored layout, for
    ``optax.apply_updates(stored_params, updates)``. Transforms that must see
    whole tensors (global-norm clipping, masks) belong inside ``inner``: padding
    is zero, so norms are those of the real tensors, and masks given as trees
    of booleans over the logical params keep their meaning.
    """

    def constrain(state):
        return jax.tree.map(jax.lax.with_sharding_constraint, state, plan.state_shardings(state))

    def init_fn(params):
        return WeightUpdateShardingState(constrain(inner.init(params)))

    def update_fn(updates, state, params=None):
        grads = plan.reduce(updates)
        updates, inner_state = inner.update(grads, state.inner_state, params)
        updates = jax.tree.map(jax.lax.with_sharding_constraint, updates, plan.stored_shardings())
        return updates, WeightUpdateShardingState(constrain(inner_state))

    return optax.GradientTransformation(init_fn, update_fn)
