"""The train state and the pure functions the trainer compiles.

One training step, for every ``optimizer.update_sharding`` mode:

1. the plan gathers the weights for the forward pass (bf16 all-gather for
   ``wus``, a local cast for ``none``, nothing for ``fsdp``);
2. ``vmap`` over the data replicas (``spmd_axis_name`` = the data mesh axes)
   computes each replica's gradient on its rows, so gradient reduction is
   explicit rather than left inside XLA's dot partitioning - that is what lets
   it run in f32 as a reduce-scatter;
3. the optax transform reduce-scatters and updates this replica's shard.

``train_loop`` runs K such steps inside one compiled ``lax.scan``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from trainer import mesh as mesh_lib
from trainer import sharding as sharding_lib
from trainer.tasks import REPLICAS, Task
from trainer.update_sharding import UpdateShardingPlan


class TrainState(NamedTuple):
    """Everything a training step reads and writes.

    Attributes:
      step: number of steps taken (int32 scalar).
      params: f32 master weights in the plan's stored (possibly sharded) layout.
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
    eval_step: Any


def make_step_fns(
    task: Task,
    plan: UpdateShardingPlan,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    rules: sharding_lib.Rules,
    state_shardings: TrainState,
) -> StepFns:
    """Builds the (un-jitted) step, K-step loop and eval step functions."""
    mesh = plan.mesh
    data_axes = mesh_lib.data_axes(mesh)
    replicas = mesh_lib.data_parallel_size(mesh)
    replica_rules = sharding_lib.without_data_axes(rules, mesh)

    def replica_loss(params, model_state, batch, rng, weight):
        variables = {"params": params, **model_state}
        loss_sum, aux = task.loss_fn(variables, batch, rng, True)
        return loss_sum / weight, aux

    def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
        params = plan.gather(state.params)
        weight = task.weight_fn(batch)
        # [batch, ...] -> [replicas, batch / replicas, ...]: a free reshape, since
        # the batch dim is already split over the data axes in this order.
        rows = jax.tree.map(lambda x: x.reshape(replicas, -1, *x.shape[1:]), batch)
        rngs = jax.random.split(jax.random.fold_in(state.rng, state.step), replicas)
        grad_fn = jax.vmap(
            jax.value_and_grad(replica_loss, has_aux=True),
            in_axes=(None, None, 0, 0, None),
            axis_name=REPLICAS,
            spmd_axis_name=data_axes,
        )
        with nn.logical_axis_rules(replica_rules):
            (_, (sums, model_state)), grads = grad_fn(params, state.model_state, rows, rngs, weight)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_state = TrainState(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
            opt_state=opt_state,
            # Replicas agree on synchronised statistics; the mean also covers
            # per-replica ones.
            model_state=jax.tree.map(lambda x: x.mean(0).astype(x.dtype), model_state),
            rng=state.rng,
        )
        new_state = jax.lax.with_sharding_constraint(new_state, state_shardings)
        metrics = {k: v.sum(0) for k, v in sums.items()}
        metrics["learning_rate"] = jnp.asarray(schedule(state.step), jnp.float32)
        return new_state, metrics

    def train_loop(state: TrainState, batches) -> tuple[TrainState, dict]:
        """K steps over ``batches`` of shape ``[K, global_batch, ...]``."""
        return jax.lax.scan(train_step, state, batches)

    def eval_step(variables, batch) -> dict:
        """Metric sums of one global eval batch (variables already gathered)."""
        with nn.logical_axis_rules(rules):
            _, (sums, _) = task.loss_fn(variables, batch, None, False)
        return sums

    return StepFns(train_step, train_loop, eval_step)
