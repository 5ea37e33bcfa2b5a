"""Everything a run is made of, built from the config, before any step runs.

``build(config)`` goes mesh -> data and task -> model and optimizer (abstract
shapes -> shardings -> a jitted init that creates the state already sharded).
The trainer, the benchmark and checkpoint restore all start from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from trainer import mesh as mesh_lib
from trainer import optimizers, update_sharding
from trainer import sharding as sharding_lib
from trainer import step as step_lib
from trainer import tasks as tasks_lib
from trainer.errors import ConfigError
from trainer.shard_layout import LeafLayout


@dataclasses.dataclass(frozen=True)
class Experiment:
    """The pieces of a run.

    Attributes:
      config: the run config.
      mesh: device mesh.
      rules: resolved logical-axis rules.
      task: model, data, loss and evaluation.
      plan: the update-sharding plan (per-parameter layouts).
      tx: the optimizer, wrapped for update sharding.
      schedule: learning-rate schedule.
      abstract_state: ShapeDtypeStructs of the train state.
      state_shardings: NamedShardings of the train state.
      fns: the step, loop and eval functions (not yet jitted).
      init: ``() -> TrainState``, created sharded.
      num_params: number of model parameters.
    """

    config: ml_collections.ConfigDict
    mesh: Mesh
    rules: sharding_lib.Rules
    task: tasks_lib.Task
    plan: update_sharding.UpdateShardingPlan
    tx: optax.GradientTransformation
    schedule: optax.Schedule
    abstract_state: step_lib.TrainState
    state_shardings: step_lib.TrainState
    fns: step_lib.StepFns
    init: Callable[[], step_lib.TrainState]
    num_params: int

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, PartitionSpec())

    def to_global(self, local, *, stacked: bool = False):
        """This process's rows -> global arrays split over the data axes
        (``stacked``: ``[K, rows, ...]``, rows on the second dim)."""
        sharding = sharding_lib.batch_sharding(self.mesh, stacked=stacked)
        axis = 1 if stacked else 0

        def one(x):
            shape = list(x.shape)
            shape[axis] *= jax.process_count()
            return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

        return jax.tree.map(one, local)

    def to_local(self, global_array):
        """A global array split over the data axes -> this process's rows."""
        spec = PartitionSpec(mesh_lib.data_axes(self.mesh))
        return multihost_utils.global_array_to_host_local_array(global_array, self.mesh, spec)

    def next_batches(self, k: int):
        """The next ``k`` training batches, stacked into one global array."""
        local = [next(self.task.train_data) for _ in range(k)]
        return self.to_global(jax.tree.map(lambda *xs: np.stack(xs), *local), stacked=True)

    def abstract_batches(self, k: int):
        """ShapeDtypeStructs of ``k`` stacked global batches."""
        sharding = sharding_lib.batch_sharding(self.mesh, stacked=True)
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (k, self.config.global_batch_size, *x.shape[1:]), x.dtype, sharding=sharding
            ),
            self.task.init_batch,
        )

    def logical_shardings(self) -> step_lib.TrainState:
        """Shardings of the train state with params and optimizer state in their
        logical shapes: the portable form checkpoints are written in."""
        plan = self.plan
        logical_opt = jax.eval_shape(plan.state_to_logical, self.abstract_state.opt_state)
        return self.state_shardings._replace(
            params=jax.tree.map(
                plan.logical_sharding, plan.layouts, is_leaf=lambda x: isinstance(x, LeafLayout)
            ),
            opt_state=plan.logical_state_shardings(logical_opt),
        )

    def abstract_logical_state(self) -> step_lib.TrainState:
        """ShapeDtypeStructs (with shardings) of the logical-shape train state."""
        shapes = jax.eval_shape(self.to_logical, self.abstract_state)
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            shapes,
            self.logical_shardings(),
        )

    def to_logical(self, state: step_lib.TrainState) -> step_lib.TrainState:
        """Stored layout -> logical shapes (padding dropped), for checkpoints."""
        return state._replace(
            params=self.plan.to_logical(state.params),
            opt_state=self.plan.state_to_logical(state.opt_state),
        )

    def from_logical(self, state: step_lib.TrainState) -> step_lib.TrainState:
        """Logical shapes -> this run's stored layout, sharded as the run wants."""

        def convert(state):
            return state._replace(
                params=self.plan.to_stored(state.params),
                opt_state=self.plan.state_to_stored(state.opt_state),
            )

        with jax.set_mesh(self.mesh):
            return jax.jit(convert, out_shardings=self.state_shardings, donate_argnums=0)(state)

    def jit_loop(self):
        """The K-step loop, jitted with explicit shardings and donated state."""
        return jax.jit(
            self.fns.train_loop,
            in_shardings=(
                self.state_shardings,
                sharding_lib.batch_sharding(self.mesh, stacked=True),
            ),
            out_shardings=(self.state_shardings, self.replicated),
            donate_argnums=0,
        )


def _check_batch(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
    batch, dp = config.global_batch_size, mesh_lib.data_parallel_size(mesh)
    procs = jax.process_count()
    if batch % dp:
        raise ConfigError(
            f"global_batch_size={batch} is not divisible by the {dp} data-parallel replicas "
            f"of mesh {dict(mesh.shape)}"
        )
    if batch % procs:
        raise ConfigError(f"global_batch_size={batch} is not divisible by {procs} processes")


def build(config: ml_collections.ConfigDict) -> Experiment:
    """Builds mesh, task, plan, optimizer and the (abstract) sharded state."""
    # ---------------------------------------------------------------- mesh
    opt_cfg = config.optimizer
    mesh = mesh_lib.make_mesh(
        config.mesh.axes.to_dict(),
        config.mesh.dcn_axes.to_dict(),
        shard_group_size=opt_cfg.shard_group_size,
        devices=jax.devices()[: config.mesh.num_devices] if config.mesh.num_devices else None,
    )
    rules = sharding_lib.resolve_rules(config.mesh.rules, mesh)
    _check_batch(config, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())

    # ------------------------------------------------------- data and task
    task = tasks_lib.make_task(
        config, process_index=jax.process_index(), process_count=jax.process_count()
    )

    # --------------------------------- model and optimizer, created sharded
    rng = jax.random.PRNGKey(config.seed)
    init_rng, state_rng = jax.random.split(rng)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(task.init_fn, init_rng, task.init_batch)
    specs = sharding_lib.param_specs(boxed["params"], rules)
    abstract_params = nn.unbox(boxed["params"])
    plan = update_sharding.make_plan(
        abstract_params,
        specs,
        mesh,
        mode=opt_cfg.update_sharding,
        min_shard_bytes=opt_cfg.min_shard_bytes,
        gather_dtype=jnp.dtype(opt_cfg.gather_dtype),
        reduce_dtype=jnp.dtype(opt_cfg.reduce_dtype),
    )
    inner, schedule = optimizers.make_optimizer(opt_cfg, abstract_params, config.num_train_steps)
    tx = update_sharding.weight_update_sharding(inner, plan)

    def init_state(rng_init, rng_state):
        variables = nn.unbox(task.init_fn(rng_init, task.init_batch))
        params = plan.to_stored(variables.pop("params"))
        return step_lib.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=variables,
            rng=rng_state,
        )

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_state = jax.eval_shape(init_state, init_rng, state_rng)
        state_shardings = step_lib.TrainState(
            step=replicated,
            params=plan.stored_shardings(),
            opt_state=plan.state_shardings(abstract_state.opt_state),
            model_state=jax.tree.map(lambda _: replicated, abstract_state.model_state),
            rng=replicated,
        )

    def init():
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return jax.jit(init_state, out_shardings=state_shardings)(init_rng, state_rng)

    return Experiment(
        config=config,
        mesh=mesh,
        rules=rules,
        task=task,
        plan=plan,
        tx=tx,
        schedule=schedule,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        fns=step_lib.make_step_fns(task, plan, tx, schedule, rules, state_shardings),
        init=init,
        num_params=sum(int(np.prod(p.shape)) for p in jax.tree.leaves(abstract_params)),
    )
