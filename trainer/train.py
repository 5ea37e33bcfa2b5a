"""``train(config, workdir)``: the whole training run, top to bottom.

Sections: checks -> build (mesh, data, model and optimizer created sharded;
see :mod:`trainer.experiment`) -> compiled loop of K steps -> host loop
(metrics, eval, checkpoint) between loops.
"""

from __future__ import annotations

import functools
import os
import signal
import time

import flax.linen as nn
import jax
import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from trainer import checkpoint as checkpoint_lib
from trainer import experiment as experiment_lib
from trainer import metrics as metrics_lib
from trainer import step as step_lib
from trainer.errors import ConfigError


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


def train(config: ml_collections.ConfigDict, workdir: str) -> step_lib.TrainState:
    """Trains ``config`` in ``workdir`` and returns the final state."""
    check_config(config)
    writer = metrics_lib.MetricWriter(workdir, enabled=jax.process_index() == 0)
    if jax.process_index() == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "config.json"), "w") as f:
            f.write(config.to_json_best_effort(indent=2))

    # ------------------------------------- mesh, data, model and optimizer
    exp = experiment_lib.build(config)
    mesh, task = exp.mesh, exp.task
    writer.info(
        f"model {config.model.name}: {exp.num_params:,} parameters; mesh {dict(mesh.shape)}; "
        f"update sharding '{exp.plan.mode}'"
    )

    # ------------------------------------------------ restore or initialise
    checkpointer = checkpoint_lib.Checkpointer(workdir, keep=config.keep_checkpoints)
    restored = checkpointer.restore(exp.abstract_logical_state())
    if restored is None:
        state = exp.init()
    else:
        saved_step, logical, data_state = restored
        state = exp.from_logical(step_lib.TrainState(**logical))
        writer.info(f"resumed from the checkpoint of step {saved_step} in {checkpointer.directory}")
        if data_state is None:
            # Each process reads its own share, so a position saved by another
            # number of processes has no meaning here.
            writer.info(
                "warning: the checkpoint was written by a different number of processes; "
                "the input pipeline starts from the beginning of its shuffle"
            )
        else:
            task.train_data.set_state(data_state)
    preemption = _Preemption(checkpointer)

    to_logical = jax.jit(exp.to_logical, out_shardings=exp.logical_shardings())

    def save(step: int, state: step_lib.TrainState, data_state) -> None:
        with jax.set_mesh(mesh):
            logical_state = to_logical(state)
        checkpointer.save(step, logical_state, data_state, config)

    # ------------------------------------------------------- compiled loop
    @functools.cache
    def compiled_loop(k: int):
        start = time.perf_counter()
        with jax.set_mesh(mesh):
            out = exp.jit_loop().lower(exp.abstract_state, exp.abstract_batches(k)).compile()
        writer.info(f"compiled a loop of {k} steps in {time.perf_counter() - start:.1f}s")
        return out

    with jax.set_mesh(mesh):
        gather = jax.jit(exp.plan.gather)
        eval_step = jax.jit(exp.fns.eval_step)

    def evaluate(state) -> dict[str, float]:
        with jax.set_mesh(mesh), nn.logical_axis_rules(exp.rules):
            variables = {"params": gather(state.params), **state.model_state}
            totals: dict[str, float] = {}
            for batch in task.eval_batches():
                sums = jax.device_get(eval_step(variables, exp.to_global(batch)))
                for key, value in sums.items():
                    totals[key] = totals.get(key, 0.0) + float(value)
            weight = max(totals.pop("weight", 0.0), 1e-9)
            out = {f"eval/{k}": v / weight for k, v in totals.items()}
            if task.evaluate_extra is not None:
                extra = task.evaluate_extra(variables, exp.to_global, exp.to_local)
                out.update({f"eval/{k}": v for k, v in extra.items()})
        return out

    # ---------------------------------------------------------- host loop
    total, k_max = config.num_train_steps, config.steps_per_loop
    step = int(state.step)
    window: list[dict] = []
    timer = metrics_lib.Throughput()
    steps_since_lap = 0
    if step < total:
        batch = exp.next_batches(min(k_max, total - step))
        batch_data_state = task.train_data.get_state()
        compiled_loop(min(k_max, total - step))
    timer.lap(0)
    while step < total:
        k = min(k_max, total - step)
        state, loop_metrics = compiled_loop(k)(state, batch)
        # The input position after this loop's batches, for its checkpoint.
        data_state = batch_data_state
        if step + k < total:  # overlaps host input work with the device loop
            batch = exp.next_batches(min(k_max, total - step - k))
            batch_data_state = task.train_data.get_state()
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
                "mfu": task.flops_per_example
                * examples_per_sec
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

        every = config.checkpoint_every_steps
        stop = preemption.requested(step)
        if (every and step % every == 0) or step == total or stop:
            save(step, state, data_state)
        if stop:
            checkpointer.wait()
            writer.info(f"preempted: saved step {step} in {checkpointer.directory}; exiting")
            break
    checkpointer.close()  # waits for the last save
    writer.close()
    return state


class _Preemption:
    """SIGTERM, or JAX's preemption notice where the platform sends one (TPU
    VMs), asks the loop to save and stop at the next loop boundary."""

    def __init__(self, checkpointer: checkpoint_lib.Checkpointer):
        self._signalled = False
        self._checkpointer = checkpointer
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self._signalled = True

    def requested(self, step: int) -> bool:
        if self._checkpointer.reached_preemption(step):
            return True
        if jax.process_count() > 1:
            # Every host must stop at the same step, whichever got the signal.
            return bool(np.any(multihost_utils.process_allgather(np.array(self._signalled))))
        return self._signalled


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
