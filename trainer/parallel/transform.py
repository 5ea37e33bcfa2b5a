"""The optax transform of weight-update sharding: any optimizer on the shards.

:func:`weight_update_sharding` wraps an optax transformation so that it runs on
the stored layout of an :class:`~trainer.parallel.plan.UpdateShardingPlan`,
every param-shaped state leaf and every update constrained to its parameter's
data shard: GSPMD then runs the update on 1/N of each tensor.

Composing with optax. The transform's contract is optax's: ``init(params)``
and ``update(grads, state, params)`` take trees in the plan's *stored* layout
(``plan.to_stored``) and the updates come back in it. Zero padding keeps
global norms, trust ratios and weight decay of the real tensors, and stored
tensors keep the logical rank, so these compose as usual::

    tx = optax.chain(
        optax.clip_by_global_norm(1.0),                # sees the reduced gradients
        weight_update_sharding(
            optax.inject_hyperparams(optax.adamw)(
                learning_rate=1e-3, mask=lambda t: jax.tree.map(lambda p: p.ndim > 1, t)
            ),
            plan,
        ),
    )
    tx = optax.MultiSteps(tx, every_k_schedule=4)      # accumulators are sharded too

A transform whose result depends on a dimension the layout changes (a mask on
``p.shape``, Adafactor's factored moments on a merged or padded tensor) computes
something else on the stored layout: :func:`check_layout_agnostic` finds that,
naming the parameter. It runs two optimizer steps, so it is the caller's to run,
once, where the experiment is built (:func:`trainer.training.experiment.build`
does); the transform itself computes nothing but its own ``init`` and ``update``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from trainer.errors import ConfigError
from trainer.parallel import run_once
from trainer.parallel.layout import LeafLayout
from trainer.parallel.plan import UpdateShardingPlan, is_layout
from trainer.parallel.rules import param_name


class WeightUpdateShardingState(NamedTuple):
    """State of :func:`weight_update_sharding`: the inner state, sharded."""

    inner_state: optax.OptState


def weight_update_sharding(
    inner: optax.GradientTransformation,
    plan: UpdateShardingPlan,
    *,
    state_dtype=None,
) -> optax.GradientTransformation:
    """Runs ``inner`` on the stored layout, each tensor on its data shard.

    ``init`` takes the master params in the stored layout; ``update`` takes
    reduced gradients in the stored layout (:meth:`UpdateShardingPlan.reduce`,
    or autodiff through :meth:`UpdateShardingPlan.gather`) and returns updates
    in it. State leaves keep the dtype they were created in (``state_dtype``,
    if given, for the param-shaped ones) and updates the gradients' dtype, so
    bf16 parameters and f32 moments coexist inside a compiled loop.

    Args:
      inner: any optax transformation.
      plan: the update-sharding plan.
      state_dtype: dtype of the param-shaped state leaves (default: the params').

    Whether ``inner`` gives the same updates on the stored layout as on the
    logical tensors is :func:`check_layout_agnostic`'s to say, called once by whoever
    builds the experiment.
    """

    def constrain(state):
        return jax.tree.map(
            jax.lax.with_sharding_constraint, state, plan.state_shardings(inner, state)
        )

    def init_fn(params):
        if not jax.tree.leaves(params):
            # optax's tree_map_params asks for the state's structure with a
            # placeholder for the params: there is nothing to cast or constrain.
            return WeightUpdateShardingState(inner.init(params))
        state = inner.init(params)
        if state_dtype is not None:
            state = plan.map_state(
                inner,
                lambda _, x: x.astype(state_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                lambda x: x,
                state,
            )
        return WeightUpdateShardingState(constrain(state))

    def update_fn(updates, state, params=None):
        new_updates, inner_state = inner.update(updates, state.inner_state, params)
        inner_state = jax.tree.map(_same_dtype, inner_state, state.inner_state)
        new_updates = jax.tree.map(
            lambda u, g, s: jax.lax.with_sharding_constraint(u.astype(g.dtype), s),
            new_updates,
            updates,
            plan.stored_shardings(),
        )
        return new_updates, WeightUpdateShardingState(constrain(inner_state))

    return optax.GradientTransformation(init_fn, update_fn)


def _same_dtype(new, old):
    """``new`` in ``old``'s dtype (state leaves that are arrays; others as they are)."""
    return new.astype(old.dtype) if hasattr(old, "dtype") and hasattr(new, "astype") else new


_CHECK_ELEMENTS = 1 << 22


def _miniature(lay: LeafLayout) -> LeafLayout:
    """``lay`` on a tensor of at most 3 per dim (the lanes' dim keeps whole lanes):
    the same dims merged, padded if ``lay`` is."""
    shape = [min(d, 3) for d in lay.shape]
    if lay.lanes:
        shape[-1] = lay.lanes
    return dataclasses.replace(lay, shape=tuple(shape), pad=1 if lay.pad else 0)


def check_layout_agnostic(
    inner: optax.GradientTransformation | Callable[[Any], optax.GradientTransformation],
    plan: UpdateShardingPlan,
    param_dtypes=None,
) -> None:
    """Refuses an optimizer whose updates depend on a dim the layout changes.

    ``inner`` is an optax transformation, or ``layouts -> transformation`` for one
    that is told the form of the tensors it is handed (a tree of
    :class:`~trainer.parallel.layout.LeafLayout`: per-layer trust ratios,
    :mod:`trainer.training.layerwise`); it is then built once for the logical form
    and once for the stored one.

    Runs two steps of ``inner`` on deterministic values twice: once with every
    parameter whose stored shape differs from its logical one in its logical
    shape, once in its stored form (the other parameters stand in as arrays of
    their rank with one element), and compares parameter by parameter. A parameter
    of more than 4M elements is checked as a miniature of its layout (every dim cut
    to at most 3, lanes kept, padded if it is): an optimizer that treats large
    tensors otherwise than small ones by their shape goes unseen.
    Elementwise updates, global norms and trust ratios agree (padding is zero,
    so norms are those of the real tensors); masks or factorings that read the
    shape may not.

    Raises:
      ConfigError: naming the first parameter where the two differ.
    """
    layouts, treedef = jax.tree.flatten(plan.layouts, is_leaf=is_layout)
    names = [
        param_name(path)
        for path, _ in jax.tree_util.tree_leaves_with_path(plan.layouts, is_leaf=is_layout)
    ]
    dtypes = (
        treedef.flatten_up_to(param_dtypes)
        if param_dtypes is not None
        else [jnp.float32] * len(layouts)
    )
    checked = [i for i, lay in enumerate(layouts) if lay.stored_shape != lay.shape]
    if not checked:
        return
    # The check runs on this host's CPU, where an LLM's stacks (gigabytes) do not fit:
    # a large parameter is checked as a miniature of its layout.
    layouts = [
        _miniature(lay) if math.prod(lay.shape) > _CHECK_ELEMENTS else lay for lay in layouts
    ]

    def values(lay, dtype, k):
        base = jnp.linspace(-1.0, 1.0, math.prod(lay.shape), dtype=jnp.float32).reshape(lay.shape)
        wave = 1.0 + 0.5 * jnp.sin(7.0 * base) if k == 0 else 0.1 * jnp.cos(3.0 * k * base + k)
        return wave.astype(dtype)

    def transformation(stored: bool) -> optax.GradientTransformation:
        if isinstance(inner, optax.GradientTransformation):
            return inner
        forms = layouts if stored else [LeafLayout(lay.shape, lay.spec) for lay in layouts]
        return inner(jax.tree.unflatten(treedef, forms))

    def run(stored: bool):
        tx = transformation(stored)

        def tree(k):
            leaves = [
                jnp.zeros((1,) * len(lay.shape), d) for lay, d in zip(layouts, dtypes, strict=True)
            ]
            for i in checked:
                value = values(layouts[i], dtypes[i], k)
                leaves[i] = layouts[i].to_stored(value) if stored else value
            return jax.tree.unflatten(treedef, leaves)

        params = tree(0)
        state = tx.init(params)
        outs = []
        for k in (1, 2):
            updates, state = tx.update(tree(k), state, params)
            leaves = treedef.flatten_up_to(updates)
            outs.append(
                [layouts[i].to_logical(leaves[i]) if stored else leaves[i] for i in checked]
            )
        return outs

    # One compiled program for both (op by op, a large tree takes many seconds), run
    # once: LLVM level 1 (trainer/parallel/run_once.py).
    cpu = jax.local_devices(backend="cpu")[0]
    with jax.default_device(cpu):
        check = jax.jit(lambda: (run(False), run(True)), compiler_options=run_once.options([cpu]))
        logical, stored = check()
    for want_step, got_step in zip(logical, stored, strict=True):
        for i, want, got in zip(checked, want_step, got_step, strict=True):
            got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
            # Relative to the tensor's scale (the order of sums may differ), and
            # non-finite only where the logical update is non-finite too.
            scale = np.nanmax(np.abs(np.where(np.isfinite(want), want, 0.0)), initial=0.0)
            diff = np.where(np.isfinite(want) & np.isfinite(got), np.abs(got - want), 0.0)
            finite_alike = np.array_equal(np.isfinite(got), np.isfinite(want))
            if not finite_alike or np.any(diff > 1e-6 * scale + 1e-5 * np.abs(want)):
                lay = layouts[i]
                raise ConfigError(
                    f"the optimizer's update of parameter {names[i]} depends on its shape, "
                    f"which update sharding changes ({lay.shape} -> stored "
                    f"{lay.stored_shape}): a mask or factoring that reads dims? Use masks "
                    f"on ndim or boolean mask trees, keep {names[i]} replicated "
                    f"(optimizer.max_shard_padding / min_shard_bytes) or use "
                    f"update_sharding=none"
                )
