"""The train state and the pure functions the trainer compiles.

One optimizer step, for every ``optimizer.update_sharding`` mode:

1. the plan gathers the weights for the forward pass (:meth:`gather`: bf16
   all-gathers where the model rounds to bf16 anyway, a no-op for replicated
   weights), handing each data replica its own copy;
2. ``vmap`` over the data replicas (``spmd_axis_name`` = the data mesh axes)
   computes each replica's gradient on its rows, so the gradient reduction is
   ours to place rather than left inside XLA's dot partitioning - that is what
   lets it run in f32 as one reduce-scatter per weight;
3. with ``accumulate_steps`` A > 1 the step's batch is split into A
   micro-batches whose per-replica gradients add up in f32, locally: the
   weights are gathered once and the gradients reduced once per step;
4. :meth:`reduce` (the gather's VJP) sums the gradients into each replica's
   shard, and the optax transform updates only that shard.

Under ``fsdp`` (ZeRO-3) the gather and the reduce move into the micro-batch
loop, and the forward pass runs under ``jax.checkpoint`` keeping only matmul
outputs: the gathered weights are not kept for the backward pass, which gathers
them again (three collectives a micro-batch instead of two a step, for the
memory of the whole weights).

Under ``per_layer`` the replicas run in a ``shard_map`` (each device's as a ``vmap``
over one): a stack's layers gather their weights inside the scan over them, and
reduce-scatter their gradients in its backward pass
(:mod:`trainer.parallel.layer_gather`); the gradients come out reduced, as under
``fsdp``.

``train_loop`` runs K such steps inside one compiled ``lax.scan``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer.parallel import layer_gather
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import rules as rules_lib
from trainer.parallel.plan import UpdateShardingPlan
from trainer.tasks import REPLICAS, Task

# Per-step scalars of the step's metrics (the others are sums over examples).
STEP_SCALARS = ("learning_rate", "grad_norm", "param_norm", "update_norm")


# Remat policy of ``fsdp``: only matmul outputs (activations) are kept for the
# backward pass. Neither the gathered weights nor anything computed from them
# (their bf16 casts) survive the forward pass, so the backward gathers again.
_KEEP_ACTIVATIONS = jax.checkpoint_policies.dots_saveable


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    Attributes:
      step: number of optimizer steps taken (int32 scalar).
      params: master weights in the plan's stored (possibly sharded) layout.
      opt_state: optimizer state, in the same layout as the params.
      model_state: non-trained variables (e.g. BatchNorm statistics), replicated.
      rng: base PRNG key; step ``s`` uses ``fold_in(rng, s)``.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any
    rng: jax.Array


class StepFns(NamedTuple):
    """The compiled-loop building blocks, closed over task, plan and optimizer."""

    train_step: Any
    train_loop: Any


def make_step_fns(
    task: Task,
    plan: UpdateShardingPlan,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    rules: rules_lib.Rules,
    state_shardings: TrainState,
    accumulate_steps: int = 1,
) -> StepFns:
    """Builds the (un-jitted) step and K-step loop functions (the eval step is
    :func:`make_eval_step`'s)."""
    mesh = plan.mesh
    replicas = mesh_lib.data_parallel_size(mesh)
    replica_rules = rules_lib.without_data_axes(rules, mesh)
    micro = accumulate_steps

    def replica_loss(params, model_state, rows, rng, weight, layer_weights=()):
        variables = {"params": params, **model_state}
        loss_sum, aux = task.loss_fn(variables, rows, rng, True, layer_weights)
        return loss_sum / weight, aux

    def over_replicas(fn):
        # Weights [replicas, ...] and rows [replicas, rows, ...] split over the data axes.
        return jax.vmap(
            fn,
            in_axes=(0, None, 0, 0, None),
            axis_name=REPLICAS,
            spmd_axis_name=mesh_lib.data_axes(mesh),
        )

    replica_grads = over_replicas(jax.value_and_grad(replica_loss, has_aux=True))
    replica_losses = over_replicas(replica_loss)

    def accumulated(grad_of, acc, model_state, rows, rngs):
        # Each micro-batch's gradients (``grad_of(model_state, rows, rngs)``) summed
        # into ``acc``, the model state carried from one to the next.
        def one(carry, xs):
            acc, model_state = carry
            (_, (sums, new_model_state)), grads = grad_of(model_state, *xs)
            return (_add(acc, grads), _averaged(new_model_state)), sums

        return _over_micro_batches(one, (acc, model_state), (rows, rngs), micro)

    def grads_gather_once(state, rows, rngs, weight):
        weights = plan.gather(state.params)  # [replicas, *logical], once per step

        def grad_of(model_state, rows, rngs):
            return replica_grads(weights, model_state, rows, rngs, weight)

        (acc, model_state), sums = accumulated(
            grad_of, _f32_zeros(weights), state.model_state, rows, rngs
        )
        return plan.reduce(acc), model_state, sums

    def grads_regather(state, rows, rngs, weight):
        def loss_of_stored(stored, model_state, rows, rngs):
            losses, aux = replica_losses(plan.gather(stored), model_state, rows, rngs, weight)
            return losses.sum(), aux

        # The backward pass gathers the weights again; the gather's VJP then
        # reduce-scatters the gradients.
        remat = jax.checkpoint(loss_of_stored, policy=_KEEP_ACTIVATIONS)
        grad_fn = functools.partial(jax.value_and_grad(remat, has_aux=True), state.params)
        (acc, model_state), sums = accumulated(
            grad_fn, _f32_zeros(state.params), state.model_state, rows, rngs
        )
        return acc, model_state, sums

    def grads_per_layer(state, rows, rngs, weight):
        # The replicas in a shard_map whose collectives are explicit: the stacks'
        # layers gather their slices in the scan, and reduce-scatter their gradients
        # in its backward pass (trainer/parallel/layer_gather.py).
        loss_of_stored = layer_gather.losses(plan, replica_loss, plan.stacks, task.lookup_tables)
        grad_fn = jax.value_and_grad(loss_of_stored, has_aux=True)

        def grad_of(model_state, rows, rngs):
            return grad_fn(state.params, model_state, rows, rngs, weight)

        (acc, model_state), sums = accumulated(
            grad_of, _f32_zeros(state.params), state.model_state, rows, rngs
        )
        return acc, model_state, sums

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        weight = task.weight_fn(batch)  # of the whole step's batch: the mean over all of it
        rows = jax.tree.map(functools.partial(_split, replicas=replicas, micro=micro), batch)
        rng = jax.random.fold_in(state.rng, state.step)
        rngs = jax.random.split(rng, micro * replicas).reshape(micro, replicas, -1)
        if plan.per_layer:
            accumulate = grads_per_layer
        else:
            accumulate = grads_regather if plan.regather else grads_gather_once
        with nn.logical_axis_rules(replica_rules):
            grads, model_state, sums = accumulate(state, rows, rngs, weight)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        new_state = TrainState(state.step + 1, params, opt_state, model_state, state.rng)
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        metrics = {k: v.sum((0, 1)) for k, v in sums.items()}
        metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        # Norms of the stored tensors: their padding is zero, so these are the
        # norms of the real ones, computed shard by shard.
        metrics["grad_norm"] = optax.tree.norm(grads)
        metrics["param_norm"] = optax.tree.norm(params)
        metrics["update_norm"] = optax.tree.norm(updates)
        return new_state, metrics

    def train_loop(state: TrainState, batches) -> tuple[TrainState, dict]:
        """K steps over ``batches`` of shape ``[K, global_batch, ...]``."""
        return jax.lax.scan(train_step, state, batches)

    return StepFns(train_step, train_loop)


def _split(x, replicas: int, micro: int):
    # [batch, ...] -> [micro, replicas, rows, ...]. The batch dim is split over the
    # data axes in replica order, so the reshape is local; each replica's rows are
    # then cut into ``micro`` consecutive pieces.
    x = x.reshape(replicas, micro, -1, *x.shape[1:])
    return jnp.swapaxes(x, 0, 1)


def _f32_zeros(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.promote_types(x.dtype, jnp.float32)), tree)


def _add(acc, grads):
    return jax.tree.map(lambda a, g: a + g.astype(a.dtype), acc, grads)


def _averaged(model_state):
    # Replicas agree on synchronised statistics; the mean also covers per-replica ones.
    return jax.tree.map(lambda x: x.mean(0).astype(x.dtype), model_state)


def _over_micro_batches(one, carry, xs, micro: int):
    # One micro-batch needs no loop (nor a loop-carried accumulator: 0 + g folds).
    if micro == 1:
        carry, out = one(carry, jax.tree.map(lambda x: x[0], xs))
        return carry, jax.tree.map(lambda x: x[None], out)
    return jax.lax.scan(one, carry, xs)


def make_eval_step(task: Task, rules: rules_lib.Rules):
    """``(variables, global batch) -> metric sums`` (variables in logical shapes)."""

    def eval_step(variables, batch) -> dict:
        with nn.logical_axis_rules(rules):
            _, (sums, _) = task.loss_fn(variables, batch, None, False)
        return sums

    return eval_step
