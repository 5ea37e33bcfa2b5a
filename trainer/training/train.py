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
from collections.abc import Callable

import jax
import ml_collections
import numpy as np
from etils import epath

from trainer import checkpoint as checkpoint_lib
from trainer import console, faults
from trainer.errors import ConfigError, UserError
from trainer.input import feed as feed_lib
from trainer.parallel import batches, hardware
from trainer.parallel import mesh as mesh_lib
from trainer.reporting import metrics as metrics_lib
from trainer.reporting import summary as summary_lib
from trainer.reporting import tracking
from trainer.reporting.window import LogWindow
from trainer.training import (
    evaluation,
    init_from,
    layerwise,
    optimizers,
    profiling,
    resume_changes,
    stopping,
)
from trainer.training import experiment as experiment_lib
from trainer.training import step as step_lib
from trainer.workdir import records, run_config, storage


class NonFiniteLossError(UserError):
    """The loss became NaN or Inf."""


# The train state counts steps in int32, and JAX (without x64) makes every Python
# integer it is handed an int32: no integer of a config may be larger.
INT_LIMIT = 2**31 - 1


def check_config(config: ml_collections.ConfigDict) -> None:
    """Fails early, with the numbers, on settings the loop cannot honour."""
    for key, value in run_config.flat_config(config).items():
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
    stop: stopping.StopRequests | None = None,
    started: float | None = None,
    accept_new_tokenizer: bool = False,
    after_compile: Callable[[], None] | None = None,
) -> step_lib.TrainState:
    """Trains ``config`` in ``workdir`` and returns the final state.

    Args:
      config: the run config (``optimizer.update_sharding`` resolved: ``auto`` is
        the command's to resolve, :func:`trainer.analysis.compiled.choose_update_sharding`).
      workdir: the run directory (a local path or a URL).
      stop: the process's stop requests (:class:`trainer.training.stopping.StopRequests`:
        ``python -m trainer`` passes its SIGTERM and Ctrl-C handling); None: none
        arrive, and Ctrl-C is Python's own KeyboardInterrupt.
      started: ``time.time()`` when the process started, for the summary's
        start-up time (default: now).
      accept_new_tokenizer: a resume may go on with another tokenizer than the run's
        (:mod:`trainer.training.resume_changes`; refused otherwise).
      after_compile: called after the training loop and the checkpoint's conversion
        are compiled (``python -m trainer`` passes
        :func:`trainer.command.process.release_freed_memory`: the compiler's freed
        heap back to the system before the steps run).

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
    stop = stop or stopping.NoStopRequests()
    # A way out that leaves at once (Ctrl-C twice, a lost peer) says so in summary.json.
    stop.on_stop_now(lambda why, failed: report.ended_now(why, failed=failed, lead=lead))
    with stopping.Run(directory, stop, lock_timeout_s=lock_timeout_s) as run:
        if lead:
            report.begin()
        try:
            state = _train(config, directory, run, report, accept_new_tokenizer, after_compile)
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
            stopped_by=run.stopped_by if run.stopped_at is not None else None,
        )
    return state


def _train(
    config: ml_collections.ConfigDict,
    directory: epath.Path,
    run: stopping.Run,
    report: summary_lib.RunReport,
    accept_new_tokenizer: bool = False,
    after_compile: Callable[[], None] | None = None,
) -> step_lib.TrainState:
    """The run, inside ``run`` (lock held; every way out goes through it)."""
    # Checks profile_steps against the loop length before anything is built.
    profiler = profiling.StepProfiler(
        config.profile_steps,
        steps_per_loop=config.steps_per_loop,
        workdir=directory,
        log=console.say,
    )

    # ------------------------------------- mesh, data, model and optimizer
    exp = experiment_lib.build(config)
    feed = feed_lib.Feed(
        exp.task.train_data, functools.partial(batches.to_global, exp.mesh, stacked=True)
    )
    run.closes(feed.close)  # data workers stop on every way out
    console.say(_describe(exp))

    # ------------------------------------------------ restore or initialise
    checkpointer = checkpoint_lib.Checkpointer(directory, keep=config.keep_checkpoints)
    run.watch(checkpointer)
    state, resumed_at = _restore_or_initialise(exp, checkpointer, feed)
    step = int(state.step)
    writer = _begin_records(exp, directory, checkpointer, step, resumed_at, accept_new_tokenizer)
    run.closes(writer.close)

    # ------------------------------------------------------- compiled loop
    compiled_loop = _loop_compiler(exp, report, after_compile)
    evaluate = _evaluator(exp)
    to_logical = _to_logical_compiler(exp, report, after_compile)

    def save(step: int, state: step_lib.TrainState, data_state) -> None:
        convert = to_logical()  # compiled at the first save, booked as a compile
        console.say(f"saving the checkpoint of step {step} (written in the background)")
        with report.timing("save"), jax.set_mesh(exp.mesh):  # the blocking part only
            checkpointer.save(step, convert(state), data_state, config)

    # ---------------------------------------------------------- host loop
    total, k_max = config.num_train_steps, config.steps_per_loop
    _say_if_nothing_to_train(step, total, resumed_at)
    divergence = metrics_lib.LossGrowthWatch(config.loss_growth_warning)
    window = _window(exp, step, resumed_at)
    report.first_step = report.last_step = step
    if config.eval_at_start and step == 0 and config.eval_every_steps > 0:
        _evaluate_start(state, evaluate, writer, report, total)
    if step < total and not run.should_stop():
        batch, position = feed.next(min(k_max, total - step))
        compiled_loop(min(k_max, total - step))
    window.restart_clock()
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
        data_state = position  # the input position after this loop's batches
        if step + k < total:  # overlaps host input work with the device loop
            batch, position = feed.next(min(k_max, total - step - k))
        loop_metrics = jax.device_get(loop_metrics)
        _check_loop(loop_metrics, step, divergence)
        step += k
        report.last_step = step
        window.add(loop_metrics, k)
        report.add("train", time.perf_counter() - loop_started)
        live.update(step)
        eval_now = _evaluates(config, step)
        if eval_now or step == total or _every(config.log_every_steps, step):
            scalars, window_steps = window.row(step, jax.local_devices())
            samples = ()
            if eval_now:
                with report.timing("eval"):
                    result = evaluate(state)
                scalars, samples = scalars | result.metrics, result.samples
                window.restart_clock()  # eval time is not training throughput
            writer.write(step, scalars, window_steps=window_steps, samples=samples)
            note = window.note(step, window_steps, config.log_every_steps or total)
            writer.progress(step, total, scalars, note=note, samples=samples)
        stop = run.should_stop()
        if _every(config.checkpoint_every_steps, step) or step == total or stop:
            save(step, state, data_state)
        if stop:
            run.stopped_at = step
            break
    profiler.stop(step)
    return state  # `run` waits for the last save and closes the files


def _begin_records(
    exp: experiment_lib.Experiment,
    directory: epath.Path,
    checkpointer: checkpoint_lib.Checkpointer,
    step: int,
    resumed_at: int | None,
    accept_new_tokenizer: bool,
) -> metrics_lib.MetricWriter:
    """Says what a resume changes (every process refuses what it must), records the
    accepted run in its work directory (process 0) and opens its metric writer, which
    continues a resumed or restarted run's events at ``step``."""
    lead, config, task = jax.process_index() == 0, exp.config, exp.task
    if resumed_at is not None:
        changes = resume_changes.compare(
            directory,
            config,
            task.run_files,
            task.input_record,
            step,
            accept_new_tokenizer=accept_new_tokenizer,
        )
        if changes and lead:
            console.say(f"resuming at step {step} with {len(changes)} change(s) to the run:")
            for change in changes:
                console.say(f"  {change.line()}")
            resume_changes.set_aside_old_files(directory, task.run_files, step)
    # Every checkpoint was unusable and moved aside: the run starts over, and says so.
    started_over = resumed_at is None and bool(checkpointer.moved_aside)
    if lead:
        corrupt = checkpointer.directory / checkpoint_lib.CORRUPT
        records.begin(
            directory,
            config,
            task.run_files,
            step,
            started_over_from=corrupt if started_over else None,
        )
        resume_changes.write_input_record(directory, task.input_record)
    writer = metrics_lib.MetricWriter(directory, enabled=lead)
    writer.log_config(config)
    if lead:
        writer.attach(tracking.start(config, directory))  # W&B, if wandb.project is set
    if resumed_at is not None or started_over:
        writer.restart_at(step)
    return writer


def _loop_compiler(
    exp: experiment_lib.Experiment,
    report: summary_lib.RunReport,
    after_compile: Callable[[], None] | None = None,
):
    """``compiled_loop(k)``: the K-step loop of ``exp``, compiled once per ``k`` (a
    phase said, its time the summary's; then ``after_compile()``)."""

    @functools.cache
    def compiled_loop(k: int):
        with console.phase(f"compiling a loop of {k} steps", done="compiled") as compiling:
            faults.point("compile")
            with jax.set_mesh(exp.mesh):
                out = experiment_lib.compile_loop(exp, k)
        report.add("compile", compiling.seconds)
        if after_compile is not None:
            after_compile()
        return out

    return compiled_loop


def _to_logical_compiler(
    exp: experiment_lib.Experiment,
    report: summary_lib.RunReport,
    after_compile: Callable[[], None] | None = None,
):
    """``to_logical()``: the train state's conversion to the checkpoint's logical shapes,
    compiled once (a phase said, its time the summary's compile, not the save's; then
    ``after_compile()``)."""

    @functools.cache
    def to_logical():
        what = "compiling the checkpoint's conversion to logical shapes"
        with console.phase(what, done="compiled") as compiling:
            abstract = jax.tree.map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                exp.abstract_state,
                exp.state_shardings,
            )
            with jax.set_mesh(exp.mesh):
                out = exp.to_logical.lower(abstract).compile()
        report.add("compile", compiling.seconds)
        if after_compile is not None:
            after_compile()
        return out

    return to_logical


def _evaluates(config: ml_collections.ConfigDict, step: int) -> bool:
    """Whether the run evaluates after ``step``: every ``eval_every_steps`` and at
    the end (``eval_every_steps=0``: never, not even at the end)."""
    every = config.eval_every_steps
    return every > 0 and (step == config.num_train_steps or step % every == 0)


def _evaluate_start(state, evaluate, writer, report, total: int) -> None:
    """The evaluation of the initial parameters: row 0 (``eval_at_start``)."""
    with report.timing("eval"):
        result = evaluate(state)
    writer.write(0, result.metrics, samples=result.samples)
    writer.progress(0, total, result.metrics, samples=result.samples)


def _every(every: int, step: int) -> bool:
    """Whether ``step`` is one of every ``every`` steps (0: never)."""
    return bool(every) and step % every == 0


def _describe(exp: experiment_lib.Experiment) -> str:
    """The run's model, devices, mesh and mode, in the line said before it starts."""
    devices, config = jax.devices(), exp.config
    line = (
        f"model {config.model.name}: {exp.model.num_params:,} parameters; "
        f"{len(devices)} {devices[0].device_kind} devices in {jax.process_count()} "
        f"process(es); mesh {dict(exp.mesh.shape)}; update sharding '{exp.plan.mode}'"
    )
    if (slices := math.prod(config.mesh.dcn_axes.values())) > 1:
        line += f"\nshard groups: {mesh_lib.describe_groups(exp.mesh, slices)}"
    views = layerwise.views(exp.plan.layouts, exp.plan.stacks)
    return line + "\n" + optimizers.describe(config.optimizer, views, config.num_train_steps)


def _restore_or_initialise(
    exp: experiment_lib.Experiment, checkpointer: checkpoint_lib.Checkpointer, feed
) -> tuple[step_lib.TrainState, int | None]:
    """``(state, the step resumed from or None)``: the newest usable checkpoint's
    state (and the input position, ``feed`` seeks it), or else the initial state."""
    # Every process restores (it synchronises them); the phase is only said if there is
    # something to read.
    reading = checkpointer.newest() is not None
    with (
        console.phase(f"reading the checkpoint in {checkpointer.directory}")
        if reading
        else contextlib.nullcontext()
    ):
        restored = checkpointer.restore(exp.logical_state, optimizer=exp.config.optimizer.name)
    if restored is None:
        with console.phase("initialising the parameters and optimizer state (sharded)"):
            return init_from.initial_state(exp, console.say), None  # exp.init(), or init_from
    saved_step, logical, data_state = restored
    state = exp.from_logical(step_lib.TrainState(**logical))
    console.say(f"resumed from the checkpoint of step {saved_step} in {checkpointer.directory}")
    feed.seek(data_state)  # the position is global: valid for any number of processes
    return state, saved_step


def _evaluator(exp: experiment_lib.Experiment):
    """``evaluate(state) -> Evaluation`` of a train state."""
    evaluate_variables = evaluation.make_evaluator(exp.model)

    def evaluate(state: step_lib.TrainState) -> evaluation.Evaluation:
        with jax.set_mesh(exp.mesh):
            params = exp.params_to_logical(state.params)
        return evaluate_variables({"params": params, **state.model_state})

    return evaluate


def _window(exp: experiment_lib.Experiment, step: int, resumed_at: int | None) -> LogWindow:
    config, devices = exp.config, jax.devices()
    return LogWindow(
        step,
        global_batch_size=config.global_batch_size,
        step_scalars=step_lib.STEP_SCALARS,
        flops_per_example=exp.task.flops_per_example,
        peak_flops=_peak_flops_per_device(config, devices) * len(devices),  # 0: no MFU
        counts_tokens=exp.task.counts_tokens,
        resumed_at=resumed_at,
    )


def _say_if_nothing_to_train(step: int, total: int, resumed_at: int | None) -> None:
    if resumed_at is not None and step > total:
        console.warn(
            f"the checkpoint of step {step} is past num_train_steps={total}: nothing to train "
            f"(raise --config.num_train_steps to train on)"
        )
    elif resumed_at is not None and step == total:
        console.say(
            f"the checkpoint of step {step} is at num_train_steps={total}: nothing to train"
        )


def _check_loop(loop_metrics: dict, first_step: int, divergence) -> None:
    """Fails on a NaN or Inf loss of the loop; warns once if the loss diverges."""
    losses = _check_finite(loop_metrics, first_step)
    warning = divergence.observe(first_step, losses, np.asarray(loop_metrics["weight"]))
    if warning is not None:
        console.warn(warning)


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
