"""Weight-update sharding with each layer of a stack gathered when it runs
(``optimizer.update_sharding="per_layer"``).

``wus`` gathers every weight before the forward pass and keeps it to the backward
pass: the whole model in bf16 on every chip, which a 32B model (64 GB) does not fit
in a v5e's 16 GB. Here a stack of layers (a scanned module, parameters
``[layers, ...]``) stays sharded through the scan: its stored layout shards each
layer's slice alike (:func:`trainer.parallel.layout.choose_layout` with ``first=1``),
the scan hands each layer its slice of every device's shard, and the layer's body
(the transform the trainer hands the model's ``layer_weights``, :mod:`models.layer_stack`)
all-gathers that slice, in ``gather_dtype`` where the model rounds to it anyway, as
the layer starts. The layer's backward pass gathers it again (the gathered weights are
never kept: the layer is rematerialised) and reduce-scatters
the layer's gradient in ``reduce_dtype`` straight into its shard. A chip holds one
layer's gathered weights at a time, and XLA may start layer i+1's gather while layer
i computes. The parameters outside the stacks (embeddings, final norms) are gathered
once and kept, as under ``wus``; except a token table that the model only looks rows up
in (the task's ``lookup_tables``, an untied input table): it stays sharded, and the
model reads it through :func:`trainer.parallel.collectives.sharded_lookup`, which
moves the rows looked up instead of the table (500 MiB a chip for a 32,000 x 8,192
table in bf16) and its gradient.

The replicas run in a ``shard_map`` over the data axes (the model axis, if any, left
to the compiler, but for the gathers and reduce-scatters, which run on each model
shard by itself: :func:`trainer.parallel.collectives.gather`; a dim that data joins
model axes on is taken apart for it, :meth:`~trainer.parallel.layout.LeafLayout.model_apart`),
where the collectives are explicit and their gradients are ours:
each gather is a ``custom_vjp`` whose backward pass is the reduce-scatter, so the
numbers are the same as ``wus``'s: the same bf16 roundings, the same f32 sums
(``tests/tasks/test_language_model.py``); a replicated parameter's gradient is
summed over the replicas by the ``shard_map``'s own transpose. Each device computes its
replica as a ``vmap`` over one, as ``wus``'s ``vmap`` over the replicas hands it one:
the model's dots alike, and XLA:CPU's fast matmuls for both (:func:`_as_batch_of_one`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from trainer.parallel import collectives, layout
from trainer.parallel import mesh as mesh_lib
from trainer.parallel.layout import LeafLayout
from trainer.parallel.rules import param_name


def _data_only(spec: PartitionSpec, data: tuple[str, ...]) -> PartitionSpec:
    """``spec`` with only the data axes (a ``shard_map`` over them sees no other)."""

    def keep(entry):
        axes = (entry,) if isinstance(entry, str) else tuple(entry or ())
        kept = tuple(a for a in axes if a in data)
        return kept[0] if len(kept) == 1 else (kept or None)

    return PartitionSpec(*(keep(e) for e in spec))


def _axes(axis) -> tuple[str, ...]:
    return (axis,) if isinstance(axis, str) else tuple(axis or ())


def _applying(fns: dict[str, Callable]) -> Callable:
    """A layer's params -> its weights: ``fns[name]`` applied to each parameter it
    names (``attention/query/kernel``), the others passed on."""

    def weights(tree):
        flat = traverse_util.flatten_dict(tree, sep="/")
        out = {name: fns[name](x) if name in fns else x for name, x in flat.items()}
        return traverse_util.unflatten_dict(out, sep="/")

    return weights


def _as_batch_of_one(loss: Callable, params, rows, rngs):
    """``loss(params, rows, rng)`` of this device's replica (``rows`` and ``rngs``
    ``[1, ...]``), as a ``vmap`` over the one: outputs ``[1, ...]``.

    As under ``wus``, whose ``vmap`` over the replicas hands each device one, the
    model's dots then have a batch dim, and XLA:CPU transposes such dots into the
    form YNNPACK runs. Without it a weight's gradient (both operands contracted over
    their tokens) stays a dot for Eigen's bf16 GEMM, many times slower: it was half of
    this mode's CPU step on the 2M decoder of ``scripts/maxtext_side_by_side.py``,
    whose step took 2.0x ``wus``'s (tests/parallel/test_wus_step.py reads the program).
    """
    return jax.vmap(loss)(jax.tree.map(lambda x: x[None], params), rows, rngs)


def _taken_apart(mesh, layouts: list[LeafLayout]) -> tuple[list[LeafLayout], Callable]:
    """The layouts the replicas' ``shard_map`` sees, each dim that data joins model axes
    on taken apart (:meth:`~trainer.parallel.layout.LeafLayout.model_apart`), and the
    function from the stored leaves to them."""
    seen = [lay.model_apart(mesh.shape) for lay in layouts]

    def leaves(stored: list[jax.Array]) -> list[jax.Array]:
        return [
            x
            if split is lay
            else jax.lax.with_sharding_constraint(  # moves nothing
                layout.apart(x, lay.dim, split.shape[lay.dim + 1]),
                NamedSharding(mesh, split.stored_spec()),
            )
            for x, split, lay in zip(stored, seen, layouts, strict=True)
        ]

    return seen, leaves


def _one_per_replica(mesh, spec: PartitionSpec) -> Callable:
    """A leaf stored as ``spec`` (the same on every replica) -> ``[replicas, ...]``, one
    copy a replica, split over ``replica``: a view that moves nothing, either way.

    Handed to the replicas' ``shard_map`` as it is, a leaf whose spec leaves out
    ``replica`` has its gradient summed over ``replica`` by the ``shard_map``'s
    transpose (``check_vma=False``), on top of the sum over ``replica`` that the
    gathers' reduce-scatters already did (:func:`trainer.parallel.collectives.gather`):
    the gradient came out ``replicas`` times too large, and a second all-reduce of
    every shard in f32 crossed the slices after the layers (v5p-32b on two slices:
    1.9 GiB a chip of the 2.9 over the DCN). Seen as one copy a replica, the leaf's
    gradient comes back one a replica, each already the sum: the backward pass keeps
    each device's own, without a transfer.
    """
    copies = PartitionSpec(mesh_lib.REPLICA_AXIS, *spec)
    # Each device's block by itself; an out_spec without ``replica`` is taken on trust
    # (check_vma=False): the blocks are equal there.
    local = functools.partial(jax.shard_map, mesh=mesh, check_vma=False)
    spread = local(lambda x: x[None], in_specs=spec, out_specs=copies)
    keep_one = local(lambda x: x[0], in_specs=copies, out_specs=spec)

    @jax.custom_vjp
    def per_replica(x):
        return spread(x)

    per_replica.defvjp(lambda x: (spread(x), None), lambda _, grad: (keep_one(grad),))
    return per_replica


def _handed(mesh, seen: list[LeafLayout], partial: bool) -> tuple[tuple, list[bool], Callable]:
    """How the replicas' ``shard_map`` receives the leaves laid out as ``seen``: their
    in_specs (the data axes only), which it receives one copy a replica (every sharded
    leaf where the gathers' reduce-scatters sum over ``replica`` themselves:
    :func:`_one_per_replica`), and the function from the leaves to what it receives."""
    data = mesh_lib.data_axes(mesh)
    copied = [partial and lay.sharded for lay in seen]
    specs, views = [], []
    for lay, c in zip(seen, copied, strict=True):
        spec = _data_only(lay.stored_spec(), data)
        specs.append(PartitionSpec(mesh_lib.REPLICA_AXIS, *spec) if c else spec)
        views.append(_one_per_replica(mesh, lay.stored_spec()) if c else None)

    def handed(leaves: list[jax.Array]) -> list[jax.Array]:
        return [view(x) if view else x for x, view in zip(leaves, views, strict=True)]

    return tuple(specs), copied, handed


def losses(
    plan, replica_loss: Callable, stacks: Any, lookup_tables: tuple[str, ...] = ()
) -> Callable:
    """``(stored, model_state, rows, rngs, weight) -> (sum of the replicas' losses,
    (their metric sums, their model states))``: ``replica_loss`` of every data
    replica, on weights gathered as the module doc says.

    Args:
      plan: the :class:`~trainer.parallel.plan.UpdateShardingPlan` (mode ``per_layer``).
      replica_loss: ``(params, model_state, rows, rng, weight, layer_weights) ->
        (loss, aux)`` of one replica (the step's); ``layer_weights`` are the
        ``(stack name, transform)`` pairs the model's stacks compute with, and
        ``(table's module, lookup)`` for the tables left sharded.
      stacks: a tree like the params: each leaf's stack (``layers``), or "".
      lookup_tables: the modules whose one parameter, a ``[vocab, features]`` table, the
        model only looks rows up in, through a ``layer_weights`` entry of the module's
        name ``(table, ids) -> rows`` (e.g. ``token_embedding``); each stays sharded
        where :func:`~trainer.parallel.collectives.lookup_eligible`, and is gathered
        like any other parameter where not.
    """
    mesh = plan.mesh
    data = mesh_lib.data_axes(mesh)
    partial = mesh.shape.get(mesh_lib.REPLICA_AXIS, 1) > 1
    flat, treedef = jax.tree_util.tree_flatten_with_path(
        plan.layouts, is_leaf=lambda x: isinstance(x, LeafLayout)
    )
    names = [param_name(path) for path, _ in flat]
    layouts = [lay for _, lay in flat]
    low = treedef.flatten_up_to(plan.low_precision)
    stack_of = treedef.flatten_up_to(stacks)
    in_layer = [bool(s) and lay.sharded for s, lay in zip(stack_of, layouts, strict=True)]
    replicas = mesh.shape[mesh_lib.DATA_AXIS]
    bits = collectives.gathers_bits(mesh)
    gather = functools.partial(collectives.gather, bits=bits, rings=mesh_lib.data_rings(mesh))
    # Leaf index -> the module that looks rows up in it, for the tables kept sharded.
    modules = [name.partition("/")[0] for name in names]
    looked_up = {
        i: module
        for i, (module, lay) in enumerate(zip(modules, layouts, strict=True))
        if module in lookup_tables and collectives.lookup_eligible(lay, replicas)
    }

    seen, taken_apart = _taken_apart(mesh, layouts)

    def gather_of(i, dtype, layer=False):
        # Leaf i's gather (of a layer's slice where ``layer``), in its logical shape.
        lay = seen[i].in_layer() if layer else seen[i]
        gather_dtype = plan.gather_dtype if low[i] else dtype
        fn = gather(lay, dtype, gather_dtype, plan.reduce_dtype, partial, plan.handed_low[i])
        return fn if seen[i] is layouts[i] else lambda x: layout.joined(fn(x), lay.dim)

    def transforms(dtypes) -> dict[str, Callable]:
        # Per stack: a layer's params (its slice of this device's shards) -> its weights.
        per_stack: dict[str, dict[str, Callable]] = {}
        for i in range(len(layouts)):
            if in_layer[i]:
                fn = gather_of(i, dtypes[i], layer=True)
                stack, _, rest = names[i].partition("/")
                per_stack.setdefault(stack_of[i], {})[rest] = fn

        readers = {stack: _applying(fns) for stack, fns in per_stack.items()}
        for i, module in looked_up.items():
            gather_dtype = plan.gather_dtype if low[i] else dtypes[i]
            table = (layouts[i], replicas, dtypes[i], gather_dtype, plan.reduce_dtype, partial)
            readers[module] = collectives.sharded_lookup(*table, bits=bits)
        return readers

    def body(leaves, model_state, rows, rngs, weight):
        leaves = [x[0] if c else x for x, c in zip(leaves, copied, strict=True)]
        dtypes = [x.dtype for x in leaves]
        weights = []
        for i, (lay, x) in enumerate(zip(layouts, leaves, strict=True)):
            if in_layer[i] or i in looked_up:
                weights.append(x)  # the layers' bodies gather their slices; lookups read it
            elif lay.sharded:
                weights.append(gather_of(i, x.dtype)(x))
            else:  # replicated: the shard_map's transpose sums its gradient over data
                weights.append(x)
        params = jax.tree.unflatten(treedef, weights)
        readers = tuple(transforms(dtypes).items())

        def this_replica(params, rows, rng):
            return replica_loss(params, model_state, rows, rng, weight, readers)

        # The model's sharding constraints may name only the axes left to the compiler;
        # with none left, no constraint at all (the vmap's would mark its own dim
        # unconstrained, which a mesh of manual axes only refuses).
        rules = (
            tuple(
                (logical, None if set(_axes(axis)) & manual else axis)
                for logical, axis in nn.get_logical_axis_rules()
            )
            if set(mesh.axis_names) - manual
            else ()
        )
        with nn.logical_axis_rules(rules):
            return _as_batch_of_one(this_replica, params, rows, rngs)

    replica = PartitionSpec(data)
    # Manual over the data axes and any of size 1: the model axis, when it splits
    # nothing, is no reason to leave kernels to the partitioner (a Pallas kernel
    # cannot be partitioned automatically).
    manual = frozenset(data) | {a for a, n in mesh.shape.items() if n == 1}
    stored_specs, copied, handed = _handed(mesh, seen, partial)

    def run(stored, model_state, rows, rngs, weight):
        leaves = handed(taken_apart(treedef.flatten_up_to(stored)))
        loss, aux = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(stored_specs, PartitionSpec(), replica, replica, PartitionSpec()),
            out_specs=(replica, replica),
            axis_names=manual,
            # Our collectives' gradients are explicit (custom_vjp); the transpose sums a
            # leaf's only over the axes its spec leaves out (:func:`_handed`).
            check_vma=False,
        )(tuple(leaves), model_state, rows, rngs, weight)
        return loss.sum(), aux

    return run
