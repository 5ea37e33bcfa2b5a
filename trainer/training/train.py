"""``train(config, workdir)``: the whole training run, top to bottom.

Sections: checks -> build (mesh, data, model and optimizer created sharded;
see :mod:`trainer.training.experiment`) -> compiled loop of K steps -> host loop
(metrics, eval, checkpoint) between loops. The run happens inside a
:class:`trainer.training.stopping.Run`: the work-directory lock, stop requests at loop
boundaries, and every way out (finish, SIGTERM, Ctrl-C, errors) handled there.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

import jax
import ml_collections
import numpy as np
from etils import epath

from trainer import checkpoint as checkpoint_lib
from trainer import errors
from trainer.command import cli, console, faults, signals
from trainer.errors import ConfigError, UserError
from trainer.input import feed as feed_lib
from trainer.parallel import batches, hardware
from trainer.parallel import mesh as mesh_lib
from trainer.reporting import metrics as metrics_lib
from trainer.reporting import rows as rows_lib
from trainer.reporting import summary as summary_lib
from trainer.reporting import tracking
from trainer.training import evaluation, init_from, profiling, stopping
from trainer.training import experiment as experiment_lib
from trainer.training import step as step_lib
from trainer.workdir import run_config, storage


class NonFiniteLossError(UserError):
    """The loss became NaN or Inf."""


# The train state counts steps in int32, and JAX (without x64) makes every Python
# integer it is handed an int32: no integer of a config may be larger.
INT_LIMIT = 2**31 - 1


def check_config(config: ml_collections.ConfigDict) -> None:
    """Fails early, with the numbers, on settings the loop cannot honour."""
    for key, value in cli.flat_config(config).items():
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > INT_LIMIT:
            raise ConfigError(
                f"{key}={value} is beyond what the run can represent: integers (step counts, "
                f"sizes) must be at most 2**31-1 = {INT_LIMIT:,} (JAX counts in int32)"
            )
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
    if config.keep_checkpoints < 1:
        raise ConfigError(
            f"keep_checkpoints must be >= 1 (the newest complete checkpoint is always kept), "
            f"got {config.keep_checkpoints}"
        )
    if config.workdir_lock_timeout_s <= 0:
        raise ConfigError(
            f"workdir_lock_timeout_s must be > 0, got {config.workdir_lock_timeout_s}"
        )


def train(
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    stop: signals.Signals | None = None,
    started: float | None = None,
) -> step_lib.TrainState:
    """Trains ``config`` in ``workdir`` and returns the final state.

    Args:
      config: the run config (``optimizer.update_sharding`` resolved: ``auto`` is
        the command's to resolve, :func:`trainer.analysis.compiled.choose_update_sharding`).
      workdir: the run directory (a local path or a URL).
      stop: the process's stop requests (:func:`trainer.command.signals.install`, as
        ``python -m trainer`` installs them); None: none arrive, and Ctrl-C is
        Python's own KeyboardInterrupt.
      started: ``time.time()`` when the process started, for the summary's
        start-up time (default: now).

    At the end (also after a stop request) process 0 says a summary and writes
    it to ``DIR/summary.json`` (:mod:`trainer.reporting.summary`).
    """
    check_config(config)
    faults.check()
    directory = storage.workdir(workdir)
    init_from.check_source(config.init_from, directory)
    lock_timeout_s = config.workdir_lock_timeout_s
    report = summary_lib.RunReport(directory, started=started)
    lead = jax.process_index() == 0
    with stopping.Run(directory, stop or signals.Signals(), lock_timeout_s=lock_timeout_s) as run:
        if lead:
            report.begin()
        try:
            state = _train(config, directory, run, report)
        except Exception as e:
            if lead:
                report.failed(e)
            raise
        ended = time.perf_counter()
    report.add("save", time.perf_counter() - ended)  # the last save, waited for on the way out
    if lead:
        report.finish(
            global_batch_size=config.global_batch_size,
            newest_checkpoint=run.newest_checkpoint,
            commands=summary_lib.commands(directory, evaluate_flags=_device_flags()),
            stopped_by=run.signals.first if run.stopped_at is not None else None,
        )
    return state


def _train(
    config: ml_collections.ConfigDict,
    directory: epath.Path,
    run: stopping.Run,
    report: summary_lib.RunReport,
) -> step_lib.TrainState:
    """The run, inside ``run`` (lock held; every way out goes through it)."""
    lead = jax.process_index() == 0
    info = console.say
    # Checks profile_steps against the loop length before anything is built.
    profiler = profiling.StepProfiler(
        config.profile_steps, steps_per_loop=config.steps_per_loop, workdir=directory, log=info
    )

    # ------------------------------------- mesh, data, model and optimizer
    exp = experiment_lib.build(config)
    mesh, task = exp.mesh, exp.task
    feed = feed_lib.Feed(task.train_data, functools.partial(batches.to_global, mesh, stacked=True))
    run.closes(feed.close)  # data workers stop on every way out
    devices = jax.devices()
    info(
        f"model {config.model.name}: {exp.model.num_params:,} parameters; "
        f"{len(devices)} {devices[0].device_kind} devices in {jax.process_count()} "
        f"process(es); mesh {dict(mesh.shape)}; update sharding '{exp.plan.mode}'"
    )
    if (slices := math.prod(config.mesh.dcn_axes.values())) > 1:
        info(f"shard groups: {mesh_lib.describe_groups(mesh, slices)}")

    # ------------------------------------------------ restore or initialise
    checkpointer = checkpoint_lib.Checkpointer(directory, keep=config.keep_checkpoints)
    run.watch(checkpointer)
    # Every process restores (it synchronises them); the phase is only said if there is
    # something to read.
    reading = checkpointer.newest() is not None
    with (
        console.phase(f"reading the checkpoint in {checkpointer.directory}")
        if reading
        else contextlib.nullcontext()
    ):
        restored = checkpointer.restore(exp.logical_state, optimizer=config.optimizer.name)
    if restored is None:
        with console.phase("initialising the parameters and optimizer state (sharded)"):
            state = init_from.initial_state(exp, info)  # exp.init(), or config.init_from
    else:
        saved_step, logical, data_state = restored
        state = exp.from_logical(step_lib.TrainState(**logical))
        info(f"resumed from the checkpoint of step {saved_step} in {checkpointer.directory}")
        # The position is global: valid for any number of processes.
        feed.seek(data_state)
    # Every checkpoint was unusable and moved aside: never start over silently, and
    # keep the metrics of the steps that are lost.
    started_over = restored is None and bool(checkpointer.moved_aside)
    if started_over:
        kept = None
        if lead:
            kept = metrics_lib.set_aside(directory, checkpointer.directory / checkpoint_lib.CORRUPT)
        errors.warn(
            f"no usable checkpoint is left in {checkpointer.directory}: this run starts from "
            "step 0" + (f"; the earlier metrics.jsonl is kept as {kept}" if kept else "")
        )
    # The config is accepted: record it, and drop metrics rows after the
    # restored step (a run that died after logging them wrote them).
    if lead:
        storage.write_atomically(directory / run_config.FILE, config.to_json_best_effort(indent=2))
        for name, content in exp.task.run_files.items():
            if not (kept := directory / name).exists() or kept.read_bytes() != content:
                storage.write_atomically(kept, content)
        if skipped := metrics_lib.drop_rows_after(directory, int(state.step)):
            errors.warn(rows_lib.skipped_warning(directory / "metrics.jsonl", skipped))
    writer = metrics_lib.MetricWriter(directory, enabled=lead)
    run.closes(writer.close)
    writer.log_config(config)
    if lead:
        writer.attach(tracking.start(config, directory))  # W&B, if wandb.project is set
    if restored is not None or started_over:
        writer.restart_at(int(state.step))

    def save(step: int, state: step_lib.TrainState, data_state) -> None:
        with jax.set_mesh(mesh):
            logical_state = exp.to_logical(state)
        checkpointer.save(step, logical_state, data_state, config)

    # ------------------------------------------------------- compiled loop
    @functools.cache
    def compiled_loop(k: int):
        with console.phase(f"compiling a loop of {k} steps", done="compiled") as compiling:
            faults.point("compile")
            with jax.set_mesh(mesh):
                out = experiment_lib.compile_loop(exp, k)
        report.add("compile", compiling.seconds)
        return out

    evaluate_variables = evaluation.make_evaluator(exp.model)

    def evaluate(state) -> dict[str, float]:
        with jax.set_mesh(mesh):
            params = exp.params_to_logical(state.params)
        return evaluate_variables({"params": params, **state.model_state})

    # ---------------------------------------------------------- host loop
    peak = _peak_flops_per_device(config, devices)  # 0: MFU left out
    total, k_max = config.num_train_steps, config.steps_per_loop
    step = int(state.step)
    if restored is not None and step > total:
        errors.warn(
            f"the checkpoint of step {step} is past num_train_steps={total}: nothing to train "
            f"(raise --config.num_train_steps to train on)"
        )
    elif restored is not None and step == total:
        info(f"the checkpoint of step {step} is at num_train_steps={total}: nothing to train")
    divergence = metrics_lib.LossGrowthWatch(config.loss_growth_warning)
    window: list[dict] = []
    timer = metrics_lib.Throughput()
    steps_since_lap = 0
    report.first_step = report.last_step = step
    if step < total and not run.should_stop():
        batch, batch_data_state = feed.next(min(k_max, total - step))
        compiled_loop(min(k_max, total - step))
    timer.lap(0)
    # The steps the next row's training metrics average: from here (a resume's first
    # row covers fewer than log_every_steps, and says so).
    window_start = step
    live = console.StepLine(step=step, total=total)
    run.closes(live.close)
    while step < total:
        if not run.trained and run.should_stop():  # asked during start-up or compile
            run.stopped_at = step
            break
        k = min(k_max, total - step)
        profiler.at_boundary(step)
        loop = compiled_loop(k)  # a shorter last loop compiles here (its own phase)
        loop_started = time.perf_counter()
        with profiler.annotate(step):
            state, loop_metrics = loop(state, batch)
        faults.point("loop")
        run.trained = True
        # The input position after this loop's batches, for its checkpoint.
        data_state = batch_data_state
        if step + k < total:  # overlaps host input work with the device loop
            batch, batch_data_state = feed.next(min(k_max, total - step - k))
        loop_metrics = jax.device_get(loop_metrics)
        losses = _check_finite(loop_metrics, step)
        warning = divergence.observe(step, losses, np.asarray(loop_metrics["weight"]))
        if warning is not None:
            errors.warn(warning)
        step += k
        report.last_step = step
        steps_since_lap += k
        window.append(loop_metrics)
        report.add("train", time.perf_counter() - loop_started)
        live.update(step)

        log_every, eval_every = config.log_every_steps, config.eval_every_steps
        log_now = log_every and step % log_every == 0
        # eval_every_steps=0: never (not even at the end).
        eval_now = eval_every and (step % eval_every == 0 or step == total)
        if log_now or eval_now or step == total:
            rate = timer.lap(steps_since_lap)
            steps_since_lap = 0
            stacked = {key: np.concatenate([w[key] for w in window]) for key in window[0]}
            window = []
            scalars = metrics_lib.reduce_loop_metrics(stacked, step_lib.STEP_SCALARS)
            examples_per_sec = rate * config.global_batch_size
            scalars |= {"steps_per_sec": rate, "examples_per_sec": examples_per_sec}
            scalars["step_time_s"] = 1.0 / max(rate, 1e-9)
            scalars |= metrics_lib.device_memory(jax.local_devices())
            if peak:
                flops_per_sec = task.flops_per_example * examples_per_sec
                scalars["mfu"] = flops_per_sec / (peak * jax.device_count())
            if task.counts_tokens:
                scalars["tokens_per_sec"] = float(np.sum(stacked["weight"])) / max(
                    len(stacked["weight"]) / rate, 1e-9
                )
            if eval_now:
                with report.timing("eval"):
                    scalars |= evaluate(state)
                timer.lap(0)  # eval time is not training throughput
            window_steps, window_start = step - window_start, step
            writer.write(step, scalars, window_steps=window_steps)
            since_resume = restored is not None and step - window_steps == saved_step
            short = since_resume and window_steps < (log_every or total)
            note = f"over the {window_steps} steps since the resume" if short else ""
            writer.progress(step, total, scalars, (total - step) / max(rate, 1e-9), note=note)

        every = config.checkpoint_every_steps
        stop = run.should_stop()
        if (every and step % every == 0) or step == total or stop:
            with report.timing("save"):  # the blocking part of an async save
                save(step, state, data_state)
        if stop:
            run.stopped_at = step
            break
    profiler.stop(step)
    return state  # `run` waits for the last save and closes the files


def _device_flags() -> str:
    """The flags that give another command this run's devices: on simulated CPU
    devices their number (the same mesh, hence the same numbers)."""
    devices = jax.devices()
    return f" --cpu_devices {len(devices)}" if devices[0].platform == "cpu" else ""


def _peak_flops_per_device(config: ml_collections.ConfigDict, devices) -> float:
    """Peak FLOP/s of one device for MFU: the config's, the device kind's
    (:func:`trainer.parallel.hardware.peak_flops_per_device`), or on CPU, if
    ``measure_cpu_peak``, measured now and said; 0.0 leaves MFU out."""
    peak = hardware.peak_flops_per_device(devices, config.peak_flops_per_device)
    if peak or devices[0].platform != "cpu" or not config.measure_cpu_peak:
        return peak
    with console.phase("measuring this machine's f32 matmul peak for MFU"):
        peak = hardware.measure_matmul_peak("float32") / len(devices)
    console.say(
        f"MFU is against {peak / 1e9:,.1f} GFLOP/s per device, this CPU's f32 matmul peak "
        "measured just now (it moves with the machine's load)"
    )
    return peak


def _check_finite(loop_metrics: dict, first_step: int) -> np.ndarray:
    """The loop's per-step losses; raises naming the first step whose loss is NaN or Inf."""
    losses = np.asarray(loop_metrics["loss"]) / np.maximum(np.asarray(loop_metrics["weight"]), 1e-9)
    bad = np.flatnonzero(~np.isfinite(losses))
    if bad.size:
        first = first_step + int(bad[0]) + 1
        raise NonFiniteLossError(
            f"loss is {losses[bad[0]]} at step {first} (loop of steps {first_step + 1}-"
            f"{first_step + len(losses)}); lower the learning rate or check the data"
        )
    return losses
