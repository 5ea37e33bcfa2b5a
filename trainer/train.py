"""``train(config, workdir)``: the whole training run, top to bottom.

Sections: checks -> mesh -> data and task -> model and optimizer (abstract
shapes -> shardings -> jit init) -> compiled loop of K steps -> host loop
(metrics, eval, checkpoint) between loops.
"""

from __future__ import annotations

import functools
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from trainer import mesh as mesh_lib
from trainer import metrics as metrics_lib
from trainer import optimizers
from trainer import sharding as sharding_lib
from trainer import step as step_lib
from trainer import tasks as tasks_lib
from trainer import update_sharding


class ConfigError(ValueError):
    """The config asks for something that cannot run; the message says why."""


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or Inf."""


def check_config(config: ml_collections.ConfigDict) -> None:
    """Fails early, with the numbers, on settings the loop cannot honour."""
    k = config.steps_per_loop
    if k < 1:
        raise ConfigError(f"steps_per_loop must be >= 1, got {k}")
    for key in ("log_every_steps", "eval_every_steps", "checkpoint_every_steps"):
        every = config[key]
        if every < 0 or every % k:
            raise ConfigError(
                f"{key}={every} must be a multiple of steps_per_loop={k} (or 0 = never): "
                f"Python only runs between compiled loops"
            )
    if config.num_train_steps < 1:
        raise ConfigError(f"num_train_steps must be >= 1, got {config.num_train_steps}")


def _check_batch(config, mesh) -> None:
    batch, dp, procs = config.global_batch_size, mesh_lib.data_parallel_size(mesh), jax.process_count()
    if batch % dp:
        raise ConfigError(
            f"global_batch_size={batch} is not divisible by the {dp} data-parallel replicas "
            f"of mesh {dict(mesh.shape)}"
        )
    if batch % procs:
        raise ConfigError(f"global_batch_size={batch} is not divisible by {procs} processes")


def _dtype(name: str):
    return jnp.dtype(name)


def train(config: ml_collections.ConfigDict, workdir: str) -> step_lib.TrainState:
    """Trains ``config`` in ``workdir`` and returns the final state."""
    check_config(config)
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    # ---------------------------------------------------------------- mesh
    opt_cfg = config.optimizer
    mesh = mesh_lib.make_mesh(
        config.mesh.axes.to_dict(),
        config.mesh.dcn_axes.to_dict(),
        shard_group_size=opt_cfg.shard_group_size,
    )
    rules = sharding_lib.resolve_rules(config.mesh.rules, mesh)
    _check_batch(config, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    batch_sharding = sharding_lib.batch_sharding(mesh)
    stacked_sharding = sharding_lib.batch_sharding(mesh, stacked=True)

    # ------------------------------------------------------- data and task
    task = tasks_lib.make_task(
        config, process_index=jax.process_index(), process_count=jax.process_count()
    )

    def to_global(local, sharding=batch_sharding, stacked=False):
        axis = 1 if stacked else 0

        def one(x):
            shape = list(x.shape)
            shape[axis] *= jax.process_count()
            return jax.make_array_from_process_local_data(sharding, x, tuple(shape))

        return jax.tree.map(one, local)

    def to_local(global_array):
        spec = PartitionSpec(mesh_lib.data_axes(mesh))
        return multihost_utils.global_array_to_host_local_array(global_array, mesh, spec)

    def next_batches(k: int):
        local = [next(task.train_data) for _ in range(k)]
        stacked = jax.tree.map(lambda *xs: np.stack(xs), *local)
        return to_global(stacked, stacked_sharding, stacked=True)

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
        gather_dtype=_dtype(opt_cfg.gather_dtype),
        reduce_dtype=_dtype(opt_cfg.reduce_dtype),
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
        state = jax.jit(init_state, out_shardings=state_shardings)(init_rng, state_rng)
    num_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(abstract_params))
    writer.info(
        f"model {config.model.name}: {num_params:,} parameters; mesh {dict(mesh.shape)}; "
        f"update sharding '{plan.mode}'"
    )

    # ------------------------------------------------------- compiled loop
    fns = step_lib.make_step_fns(task, plan, tx, schedule, rules, state_shardings)

    @functools.cache
    def compiled_loop(k: int):
        start = time.perf_counter()
        fn = jax.jit(
            fns.train_loop,
            in_shardings=(state_shardings, stacked_sharding),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )
        abstract_batch = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                (k, config.global_batch_size, *x.shape[1:]), x.dtype, sharding=stacked_sharding
            ),
            task.init_batch,
        )
        with jax.set_mesh(mesh):
            out = fn.lower(abstract_state, abstract_batch).compile()
        writer.info(f"compiled a loop of {k} steps in {time.perf_counter() - start:.1f}s")
        return out

    with jax.set_mesh(mesh):
        gather = jax.jit(plan.gather)
        eval_step = jax.jit(fns.eval_step)

    def evaluate(state) -> dict[str, float]:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            variables = {"params": gather(state.params), **state.model_state}
            totals: dict[str, float] = {}
            for batch in task.eval_batches():
                sums = jax.device_get(eval_step(variables, to_global(batch)))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
            weight = max(totals.pop("weight", 0.0), 1e-9)
            out = {f"eval/{k}": v / weight for k, v in totals.items()}
            if task.evaluate_extra is not None:
                extra = task.evaluate_extra(variables, to_global, to_local)
                out.update({f"eval/{k}": v for k, v in extra.items()})
        return out

    # ---------------------------------------------------------- host loop
    total, k_max = config.num_train_steps, config.steps_per_loop
    step = int(state.step)
    window: list[dict] = []
    timer = metrics_lib.Throughput()
    steps_since_lap = 0
    batch = next_batches(min(k_max, total - step))
    compiled_loop(min(k_max, total - step))
    timer.lap(0)
    while step < total:
        k = min(k_max, total - step)
        state, loop_metrics = compiled_loop(k)(state, batch)
        if step + k < total:  # overlaps host input work with the device loop
            batch = next_batches(min(k_max, total - step - k))
        loop_metrics = jax.device_get(loop_metrics)
        _check_finite(loop_metrics, step)
        step += k
        steps_since_lap += k
        window.append(loop_metrics)

        log_now = config.log_every_steps and step % config.log_every_steps == 0
        eval_now = config.eval_every_steps and step % config.eval_every_steps == 0
        if log_now or eval_now or step == total:
            rate = timer.lap(steps_since_lap)
            steps_since_lap = 0
            stacked = {key: np.concatenate([w[key] for w in window]) for key in window[0]}
            window = []
            scalars = metrics_lib.reduce_loop_metrics(stacked)
            examples_per_sec = rate * config.global_batch_size
            scalars |= {
                "steps_per_sec": rate,
                "examples_per_sec": examples_per_sec,
                "mfu": task.flops_per_example * examples_per_sec
                / (config.peak_flops_per_device * jax.device_count()),
            }
            if task.counts_tokens:
                scalars["tokens_per_sec"] = float(np.sum(stacked["weight"])) / max(
                    len(stacked["weight"]) / rate, 1e-9
                )
            if eval_now or step == total:
                scalars |= evaluate(state)
                timer.lap(0)  # eval time is not training throughput
            writer.write(step, scalars)
            writer.progress(step, total, scalars, (total - step) / max(rate, 1e-9))
    writer.close()
    return state


def _check_finite(loop_metrics: dict, first_step: int) -> None:
    """Raises naming the first step whose loss is NaN or Inf."""
    losses = np.asarray(loop_metrics["loss"]) / np.maximum(np.asarray(loop_metrics["weight"]), 1e-9)
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        first = first_step + int(bad[0]) + 1
        raise NonFiniteLossError(
            f"loss is {losses[bad[0]]} at step {first} (loop of steps {first_step + 1}-"
            f"{first_step + len(losses)}); lower the learning rate or check the data"
        )
