"""Weight-update sharding (Xu et al. 2020): a layout plan and its two collectives.

In plain data parallelism every replica repeats the whole weight update. Here
each data replica owns one shard of every (large enough) parameter:

* the master weights and the optimizer state are stored *sharded* over the
  ``data`` mesh axis (layouts: :mod:`trainer.parallel.layout`), and stay sharded
  across the steps of the compiled loop;
* :meth:`UpdateShardingPlan.gather` hands each replica the whole weights for
  its forward pass: one all-gather per sharded weight, in bf16 for the weights
  whose every consumer rounds them to bf16 anyway (:mod:`trainer.parallel.precision`)
  and in their own dtype otherwise, so the model computes exactly what it would
  on unsharded weights. It is a differentiable collective: its VJP is
* :meth:`UpdateShardingPlan.reduce`, which sums the per-replica gradients in
  ``reduce_dtype`` (f32) with one reduce-scatter per sharded weight, straight
  into the stored layout (padding included: padded entries get zero);
* :func:`trainer.parallel.transform.weight_update_sharding` runs any optax optimizer on the reduced,
  stored-layout gradients; every param-shaped state leaf and every update is
  constrained to its parameter's shard, so GSPMD runs the update on 1/N of
  each tensor.

Modes (``optimizer.update_sharding``), all with the same dtype policy, so they
differ only in where state lives and which collectives run:

* ``none``: everything replicated; the gradients are all-reduced in f32.
* ``wus``: as above; the gathered weights live from the forward pass to the
  backward pass of the step (gathered once per step, however many micro-batches).
* ``fsdp``: ZeRO-3 as DeepSpeed/FSDP users know it: the same sharded storage,
  but the gathered weights are not kept for the backward pass - they are
  gathered again there (rematerialised), trading a third collective for the
  memory of the whole weights.
* ``per_layer``: as ``wus``, but a stack of layers (a scanned module) stays sharded
  through its scan: each layer's slice is gathered inside the scan's body when the
  layer runs, again in its backward pass, and its gradient is reduce-scattered
  there (:mod:`trainer.parallel.layer_gather`): one layer's weights on a chip at a
  time, for a model whose bf16 weights do not fit a chip.

"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer.errors import ConfigError
from trainer.parallel import collectives
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import rules as rules_lib
from trainer.parallel.layout import LeafLayout, choose_layout

MODES = ("none", "wus", "fsdp", "per_layer")


def is_layout(x) -> bool:
    """Whether ``x`` is a leaf of a plan's layout tree (for ``jax.tree`` calls)."""
    return isinstance(x, LeafLayout)


@dataclasses.dataclass(frozen=True)
class UpdateShardingPlan:
    """Per-parameter layouts and gather dtypes, plus the collectives between them.

    Attributes:
      mesh: the device mesh (with ``data`` and possibly ``replica`` axes).
      mode: one of :data:`MODES`.
      layouts: a tree of :class:`LeafLayout`, shaped like the params.
      low_precision: a tree of bools: gather this parameter in ``gather_dtype``.
      kept_low: a tree of bools: of those, the ones handed to the model still in
        ``gather_dtype`` (:class:`trainer.parallel.precision.Precision`); None: none.
      gather_dtype: dtype the low-precision weights are all-gathered in.
      reduce_dtype: dtype gradients are summed in.
      gather_buckets: groups of sharded parameters (indices into the flattened
        layouts) gathered by one all-gather: their shards concatenated, gathered,
        and each parameter cut out of the result (:func:`bucket_gathers`). The
        other sharded parameters are gathered one by one.
      stacks: a tree like the params: the stack of layers each parameter belongs to
        (its scanned module's name, e.g. ``layers``), or "" (``per_layer`` gathers
        the stacks' parameters a layer at a time).
    """

    mesh: Mesh
    mode: str
    layouts: Any
    low_precision: Any
    kept_low: Any = None
    gather_dtype: Any = jnp.bfloat16
    reduce_dtype: Any = jnp.float32
    gather_buckets: tuple[tuple[int, ...], ...] = ()
    stacks: Any = None

    def _map(self, fn, *trees):
        return jax.tree.map(fn, self.layouts, *trees, is_leaf=is_layout)

    def _flat(self):
        layouts, treedef = jax.tree.flatten(self.layouts, is_leaf=is_layout)
        return layouts, treedef.flatten_up_to(self.low_precision), treedef

    @property
    def handed_low(self) -> list[bool]:
        """Per leaf (flattened as the layouts): whether its gathered weight reaches the
        model in ``gather_dtype`` rather than cast back to its own: sharded, gathered in
        ``gather_dtype``, and rounded once by the model with nothing of its gradient
        summed before (``kept_low``). Cast back, a layer stack would enter the layers'
        scan as a float32 copy of the stacked model, held to the backward pass; the
        numbers are the same either way."""
        layouts, low, treedef = self._flat()
        if self.kept_low is None:
            return [False] * len(layouts)
        kept = treedef.flatten_up_to(self.kept_low)
        return [lay.sharded and lo and k for lay, lo, k in zip(layouts, low, kept, strict=True)]

    @property
    def regather(self) -> bool:
        """Whether the backward pass gathers the weights again (``fsdp``)."""
        return self.mode == "fsdp"

    @property
    def per_layer(self) -> bool:
        """Whether the stacks' layers are gathered one at a time inside their scans."""
        return self.mode == "per_layer"

    def stored_shardings(self):
        """NamedShardings of the stored (master) params."""
        return self._map(lambda lay: NamedSharding(self.mesh, lay.stored_spec()))

    def to_stored(self, params):
        """Logical params -> stored layout, constrained to the stored shardings."""
        return self._map(
            lambda lay, x: jax.lax.with_sharding_constraint(
                lay.to_stored(x), NamedSharding(self.mesh, lay.stored_spec())
            ),
            params,
        )

    def spread(self, params):
        """Logical params constrained to be spread over ``data`` where they are made.

        Applied to the initialisers' output, it lets the partitioner draw each device's
        share of the random values only (JAX's threefry is partitionable: the values do
        not depend on the split); constrained to the stored layout alone, which
        reshapes and pads, every device drew every tensor whole: 0.95 GiB of
        temporaries a device for a 64M-parameter decoder, 7.6 GiB a process on 8 CPU
        devices. A parameter stored split on one dimension past the first, evenly, is
        split so; another on its largest dimension the data axis divides that no model
        axis holds (not by layer where it can be helped: a stack is assembled from its
        layers' values, and split by layer each device would draw every layer), or
        replicated where none does. A layout that merges dimensions is left to the
        partitioner, which carries the stored split back through the reshape (a split
        over several dimensions, which one named axis cannot say: a constraint here
        made XLA replicate the tensor to reshard it, and warn).
        """
        return self._map(
            lambda lay, x: (
                x
                if lay.sharded and lay.stop - lay.start > 1
                else jax.lax.with_sharding_constraint(x, self._spread_sharding(lay))
            ),
            params,
        )

    def _spread_sharding(self, lay: LeafLayout) -> NamedSharding:
        if lay.sharded and lay.stored_shape == lay.shape and lay.start > 0:
            return self.logical_sharding(lay)  # the stored split, past the layers' dim
        data = self.mesh.shape[mesh_lib.DATA_AXIS]
        entries = list(lay.logical_spec())
        free = [d for d, size in enumerate(lay.shape) if not lay.spec[d] and size % data == 0]
        if data > 1 and free:
            entries[max(free, key=lambda d: (lay.shape[d], d))] = mesh_lib.DATA_AXIS
        return NamedSharding(self.mesh, PartitionSpec(*entries))

    def to_logical(self, stored):
        """Stored params -> logical shapes (no cast)."""
        return self._map(lambda lay, x: lay.to_logical(x), stored)

    def _replica_spec(self, lay: LeafLayout) -> PartitionSpec:
        """``[replicas, *logical]`` with one replica's copy per data-parallel device."""
        return PartitionSpec(mesh_lib.data_axes(self.mesh), *lay.logical_spec())

    def gather(self, stored):
        """The weights each data replica computes with: ``[replicas, *logical]``.

        Dim 0 is split over the data axes, so each device holds its replica's
        copy. Sharded weights are all-gathered - in ``gather_dtype`` where
        ``low_precision`` says every consumer rounds them anyway - and come
        back in their own dtype, or still in ``gather_dtype`` where
        :attr:`handed_low`; replicated weights are passed on untouched.
        Differentiable: the VJP is :meth:`reduce`, into the stored dtypes.

        Everything happens inside one ``shard_map`` (formatting included), so a
        rematerialisation policy can tell the gathered weights apart by their
        producer and gather them again rather than keep them (``fsdp``).
        """

        @jax.custom_vjp
        def gathered(stored):
            return self._gather(stored)

        def forward(stored):
            return self._gather(stored), None

        dtypes = jax.tree.map(lambda x: x.dtype, stored)

        def backward(_, per_replica_grads):
            return (self.reduce(per_replica_grads, dtypes),)

        gathered.defvjp(forward, backward)
        return gathered(stored)

    def _gather(self, stored):
        layouts, low, treedef = self._flat()
        handed_low = self.handed_low
        bucketed = {i: bucket for bucket in self.gather_buckets for i in bucket}
        replicas = self.mesh.shape[mesh_lib.DATA_AXIS]
        gather_all = functools.partial(
            collectives.all_gather, bits=collectives.gathers_bits(self.mesh)
        )

        def body(*leaves):
            # Cast on the shard, so the collective moves bf16.
            shards = [
                x.astype(self.gather_dtype) if lay.sharded and round_it else x
                for lay, round_it, x in zip(layouts, low, leaves, strict=True)
            ]
            gathered = {}
            for bucket in self.gather_buckets:
                members = [(shards[i], layouts[i].dim) for i in bucket]
                gathered.update(
                    zip(bucket, _gather_bucket(members, replicas, gather_all), strict=True)
                )
            out = []
            for i, (lay, x) in enumerate(zip(layouts, shards, strict=True)):
                if i in bucketed:
                    x = gathered[i]
                elif lay.sharded:
                    x = collectives.on_major_dim(gather_all, x, lay.dim)
                dtype = self.gather_dtype if handed_low[i] else leaves[i].dtype
                out.append(lay.to_logical(x).astype(dtype)[None])
            return tuple(out)

        gathered = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(lay.stored_spec() for lay in layouts),
            out_specs=tuple(self._replica_spec(lay) for lay in layouts),
            # A tiled all_gather's result is the same on every data replica, but
            # the varying-axes check cannot infer that.
            check_vma=False,
        )(*treedef.flatten_up_to(stored))
        return jax.tree.unflatten(treedef, gathered)

    def reduce(self, per_replica_grads, dtypes=None):
        """Sums per-replica gradients into the stored layout.

        Args:
          per_replica_grads: tree of ``[replicas, *logical_shape]`` arrays, dim 0
            split over the data axes (one row per replica).
          dtypes: a tree like it of the dtypes to return (default: the gradients'
            own).

        Returns:
          The summed gradients in the stored layout and ``dtypes``, summed
          in ``reduce_dtype``: reduce-scattered over ``data`` (then all-reduced
          over ``replica`` for partial sharding) for sharded leaves, all-reduced
          otherwise. Padding gets zeros.
        """
        layouts, _, treedef = self._flat()
        if dtypes is None:
            dtypes = jax.tree.map(lambda g: g.dtype, per_replica_grads)
        out_dtypes = treedef.flatten_up_to(dtypes)
        data_axes = mesh_lib.data_axes(self.mesh)
        partial = self.mesh.shape.get(mesh_lib.REPLICA_AXIS, 1) > 1
        scatter = functools.partial(
            collectives.reduce_scatter, rings=mesh_lib.data_rings(self.mesh)
        )

        def body(*leaves):
            out = []
            for lay, g, dtype in zip(layouts, leaves, out_dtypes, strict=True):
                g = lay.to_stored(g[0]).astype(self.reduce_dtype)  # this replica's gradient
                if lay.sharded:
                    g = collectives.on_major_dim(scatter, g, lay.dim)
                    if partial:
                        g = jax.lax.psum(g, mesh_lib.REPLICA_AXIS)
                else:
                    g = jax.lax.psum(g, data_axes)
                out.append(g.astype(dtype))
            return tuple(out)

        reduced = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=tuple(self._replica_spec(lay) for lay in layouts),
            out_specs=tuple(lay.stored_spec() for lay in layouts),
            # Without partial sharding the replica axis has size 1 and is not
            # reduced over (a psum there would still emit an all-reduce).
            check_vma=False,
        )(*treedef.flatten_up_to(per_replica_grads))
        return jax.tree.unflatten(treedef, reduced)

    def map_state(self, optimizer, fn, other, state):
        """Maps ``fn(layout, leaf)`` over the param-shaped leaves of ``optimizer``'s
        state and ``other(leaf)`` over the rest (counts, scalars).

        The param-shaped leaves are every copy of the params tree the optimizer
        keeps (Adam's ``mu`` and ``nu``, momentum, MultiSteps' accumulators), as
        ``optax.tree_utils.tree_map_params`` finds them from the optimizer's
        ``init``; leaves ``optax.masked`` leaves out stay as they are.

        Args:
          optimizer: the transformation (or its ``init``) whose state this is.
          fn: ``(layout, leaf) -> new leaf`` for a parameter's copy.
          other: ``leaf -> new leaf`` for everything else.
          state: the state (arrays or ShapeDtypeStructs, stored or logical shapes).
        """

        def param(leaf, lay):
            return leaf if isinstance(leaf, optax.MaskedNode) else fn(lay, leaf)

        return optax.tree_utils.tree_map_params(
            optimizer,
            param,
            state,
            self.layouts,
            transform_non_params=lambda x: jax.tree.map(other, x),
            is_leaf=lambda x: isinstance(x, optax.MaskedNode),
        )

    def state_shardings(self, optimizer, state):
        """Shardings for ``optimizer``'s state (arrays or ShapeDtypeStructs): param-
        shaped leaves follow their parameter's layout, the rest is replicated."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return self.map_state(
            optimizer,
            lambda lay, _: NamedSharding(self.mesh, lay.stored_spec()),
            lambda _: replicated,
            state,
        )

    def logical_sharding(self, lay: LeafLayout) -> NamedSharding:
        """Sharding of a parameter in its logical shape, for checkpoints: the
        stored sharding where the layout neither merges nor pads, else model axes."""
        same = lay.stored_shape == lay.shape
        return NamedSharding(self.mesh, lay.stored_spec() if same else lay.logical_spec())

    # -- A whole train state (a NamedTuple with ``params`` and ``opt_state``) in the
    # -- stored layout and in logical shapes, the portable form checkpoints hold.

    def train_state_to_logical(self, optimizer, state):
        """Stored layout -> logical shapes, padding dropped (no cast)."""
        return state._replace(
            params=self.to_logical(state.params),
            opt_state=self.map_state(
                optimizer, lambda lay, x: lay.to_logical(x), lambda x: x, state.opt_state
            ),
        )

    def train_state_to_stored(self, optimizer, state):
        """Logical shapes -> stored layout, constrained to the stored shardings."""

        def stored(lay, x):
            return jax.lax.with_sharding_constraint(
                lay.to_stored(x), NamedSharding(self.mesh, lay.stored_spec())
            )

        return state._replace(
            params=self.to_stored(state.params),
            opt_state=self.map_state(optimizer, stored, lambda x: x, state.opt_state),
        )

    def logical_train_state_shardings(self, optimizer, logical_state, state_shardings):
        """Shardings of a train state in logical shapes: the params and their copies
        in the optimizer state by :meth:`logical_sharding`, the rest as the run's."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return state_shardings._replace(
            params=jax.tree.map(self.logical_sharding, self.layouts, is_leaf=is_layout),
            opt_state=self.map_state(
                optimizer,
                lambda lay, _: self.logical_sharding(lay),
                lambda _: replicated,
                logical_state.opt_state,
            ),
        )

    def table(self, num_slices: int = 1) -> list[tuple[str, tuple[int, ...], str, str]]:
        """(name, logical shape, layout and gather dtype, what crosses slices) for every
        parameter; the last is "" on one slice (``num_slices``: the config's DCN axes).

        Across slices, only the reduction that spans them crosses the data-center
        network: a sharded parameter's reduce-scatter stays inside its group (a
        slice's), and the all-reduce of its shard across groups crosses, 1/G of the
        gradient; a replicated one's gradient all-reduce crosses whole. (The TPU
        compiler reduces inside each slice before the DCN: what a device sends is
        this divided by the slice's other participants; ``trainer.aot`` reads it.)
        The gathers never cross.
        """
        layouts, low, treedef = self._flat()
        paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(self.layouts, is_leaf=is_layout)]
        bucket_of = {i: b for b, bucket in enumerate(self.gather_buckets) for i in bucket}
        group = self.mesh.shape[mesh_lib.DATA_AXIS]
        reduce_bytes = np.dtype(self.reduce_dtype).itemsize
        rows = []
        for i, (path, lay, round_it) in enumerate(zip(paths, layouts, low, strict=True)):
            crossing = ""
            if num_slices > 1:
                elements = math.prod(lay.stored_shape) // (group if lay.sharded else 1)
                what = "shard all-reduced across groups" if lay.sharded else "all-reduced"
                crossing = f"{what}, {elements * reduce_bytes:,} B"
            gather = (
                f", gathered in {np.dtype(self.gather_dtype).name}"
                if lay.sharded and round_it
                else ""
            )
            if i in bucket_of:
                gather += f" in bucket {bucket_of[i]}"
            rows.append((rules_lib.param_name(path), lay.shape, lay.describe() + gather, crossing))
        return rows


def _gather_bucket(
    members: list[tuple[jax.Array, int]], replicas: int, gather_all: Callable
) -> list[jax.Array]:
    """All-gathers several contiguously sharded tensors with one collective
    (``gather_all``: :func:`~trainer.parallel.collectives.all_gather`).

    ``members`` are (local shard, sharded dim), with only size-1 dims before the
    sharded one. Their shards, flattened and concatenated, are gathered into
    ``[replicas, sum of shard sizes]``; each tensor is its columns of that, its
    replicas' shards stacked on the sharded dim.
    """
    flat = jnp.concatenate([x.reshape(-1) for x, _ in members])
    rows = gather_all(flat, 0).reshape(replicas, flat.size)
    out, offset = [], 0
    for x, dim in members:
        lead, shard = x.shape[:dim], x.shape[dim:]
        part = rows[:, offset : offset + x.size].reshape(replicas * shard[0], *shard[1:])
        out.append(part.reshape(lead + part.shape))
        offset += x.size
    return out


def bucket_gathers(layouts, gather_bytes, bucket_bytes: int) -> tuple[tuple[int, ...], ...]:
    """Which sharded parameters share an all-gather: of those that are contiguous
    shards (only size-1 dims before the sharded one) and gather at most
    ``bucket_bytes`` each, consecutive ones of the same gather dtype, until their
    gathered bytes would exceed ``bucket_bytes``. Buckets of one are left out.

    Args:
      layouts: the flattened :class:`LeafLayout` of every parameter.
      gather_bytes: per parameter, ``(gather dtype name, bytes gathered per device)``.
      bucket_bytes: the most a bucket gathers per device; 0 = no buckets.
    """
    if bucket_bytes <= 0:
        return ()
    open_: dict[str, tuple[list[int], int]] = {}
    buckets = []
    for i, (lay, (dtype, size)) in enumerate(zip(layouts, gather_bytes, strict=True)):
        contiguous = lay.sharded and all(d == 1 for d in lay.stored_shape[: lay.dim])
        if not contiguous or size > bucket_bytes:
            continue
        members, total = open_.get(dtype, ([], 0))
        if total + size > bucket_bytes:
            buckets.append(tuple(members))
            members, total = [], 0
        open_[dtype] = (members + [i], total + size)
    buckets += [tuple(members) for members, _ in open_.values()]
    return tuple(b for b in buckets if len(b) > 1)


def make_plan(
    abstract_params,
    param_specs,
    mesh: Mesh,
    *,
    mode: str = "wus",
    min_shard_bytes: int = 65536,
    max_shard_padding: float = 0.25,
    low_precision=None,
    kept_low=None,
    gather_dtype=jnp.bfloat16,
    reduce_dtype=jnp.float32,
    gather_bucket_bytes: int = 0,
    stacks=None,
) -> UpdateShardingPlan:
    """Chooses a layout for every parameter.

    Args:
      abstract_params: tree of arrays or ShapeDtypeStructs (logical shapes).
      param_specs: matching tree of PartitionSpecs (model-parallel sharding).
      mesh: device mesh with a ``data`` axis.
      mode: ``none``, ``wus`` or ``fsdp``.
      min_shard_bytes: parameters with fewer bytes per device (after model
        sharding) stay replicated.
      max_shard_padding: the largest padding (fraction of the tensor) a layout may add.
      low_precision: tree of bools, which parameters may be gathered in
        ``gather_dtype`` (see :mod:`trainer.parallel.precision`); default: none.
      kept_low: tree of bools, which of those may reach the model in
        ``gather_dtype`` (:class:`trainer.parallel.precision.Precision`); default: none.
      gather_dtype: dtype of the low-precision weight all-gathers.
      reduce_dtype: dtype of the gradient reduction.
      gather_bucket_bytes: small sharded parameters share all-gathers of up to this
        many bytes per device (:func:`bucket_gathers`); 0 = one per parameter.
      stacks: tree of each parameter's stack of layers, or "" (default: none);
        under ``per_layer`` a stack's parameters are laid out a layer at a time.
    """
    if mode not in MODES:
        raise ConfigError(
            f"optimizer.update_sharding must be one of {', '.join((*MODES, 'auto'))}, got '{mode}'"
        )
    if max_shard_padding < 0:
        raise ConfigError(f"optimizer.max_shard_padding must be >= 0, got {max_shard_padding}")
    shards = mesh.shape[mesh_lib.DATA_AXIS] if mode != "none" else 1
    if stacks is None:
        stacks = jax.tree.map(lambda _: "", abstract_params)
    if mode == "per_layer" and not any(jax.tree.leaves(stacks)):
        raise ConfigError(
            "optimizer.update_sharding='per_layer' gathers the layers of a scanned stack "
            "one at a time, and this model has none: use wus or fsdp (or, for a model "
            "with a model.scan_layers key, set it true)"
        )
    layouts = jax.tree.map(
        lambda p, s, stack: choose_layout(
            tuple(p.shape),
            s,
            shards,
            axis_sizes=dict(mesh.shape),
            itemsize=np.dtype(p.dtype).itemsize,
            min_shard_bytes=min_shard_bytes,
            max_padding=max_shard_padding,
            first=1 if stack and mode == "per_layer" else 0,
        ),
        abstract_params,
        param_specs,
        stacks,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    if mode == "per_layer":
        gather_bucket_bytes = 0  # the layers' gathers are the scan's, one by one
    if low_precision is None:
        low_precision = jax.tree.map(lambda _: False, abstract_params)
    if gather_bucket_bytes < 0:
        raise ConfigError(f"optimizer.gather_bucket_bytes must be >= 0, got {gather_bucket_bytes}")
    flat_layouts = jax.tree.leaves(layouts, is_leaf=is_layout)
    gathered = []  # (dtype, bytes per device) of each parameter's all-gather
    for lay, low, p in zip(
        flat_layouts, jax.tree.leaves(low_precision), jax.tree.leaves(abstract_params), strict=True
    ):
        dtype = np.dtype(gather_dtype if low else p.dtype)
        gathered.append((dtype.name, math.prod(lay.stored_shape) * dtype.itemsize))
    return UpdateShardingPlan(
        mesh,
        mode,
        layouts,
        low_precision,
        kept_low,
        jnp.dtype(gather_dtype),
        jnp.dtype(reduce_dtype),
        bucket_gathers(flat_layouts, gathered, gather_bucket_bytes),
        stacks,
    )
