"""What the user sees: a console line, ``metrics.jsonl`` and TensorBoard events.

Only the process that owns the writer (process 0) writes; the others get a
writer with ``enabled=False`` so the training code has no ``if`` around logging.
"""

from __future__ import annotations

import collections
import json
import math
import os
import sys
import time

import numpy as np

from trainer import console
from trainer.errors import ConfigError, UserError
from trainer.workdir import run_config, storage

# metrics.jsonl in an object store is rewritten whole when flushed: at most this often.
_REMOTE_FLUSH_SECS = 10.0


# The run's config as TensorBoard hparams (MetricWriter.log_config).
HPARAMS_EVENTS = "events.out.tfevents.0.hparams"


def _tensorboardx():
    """The tensorboardX package with the modules used here, imported on first use: it
    imports torch where that is installed (1.5 s of a command's start on 2 cores, with
    the Hugging Face extra), which a command that writes no events need not pay."""
    import tensorboardX  # noqa: PLC0415
    import tensorboardX.proto.event_pb2  # noqa: PLC0415
    import tensorboardX.record_writer  # noqa: PLC0415
    import tensorboardX.summary  # noqa: PLC0415

    return tensorboardX


def tensorboard_tag(key: str) -> str:
    """A metric's TensorBoard (and W&B) name: training scalars under ``train/``
    (``loss`` -> ``train/loss``); ``eval/...`` and ``memory/...`` keep theirs."""
    return key if "/" in key else f"train/{key}"


def flat_hparams(config) -> dict[str, str | float | bool]:
    """A config as TensorBoard hparams: ``{"optimizer.learning_rate": 0.001, ...}``;
    values that are not numbers, strings or booleans (tuples, None) as text."""
    return {
        key: value if isinstance(value, bool | int | float | str) else str(value)
        for key, value in run_config.flat_config(config).items()
    }


class MetricWriter:
    """Writes scalars to ``workdir/metrics.jsonl`` and TensorBoard, and prints
    a progress line.

    In TensorBoard, training scalars are under ``train/`` beside ``eval/``
    (:func:`tensorboard_tag`), and the config is the run's hparams
    (:meth:`log_config`; the HParams dashboard lists it against the metrics).

    Args:
      workdir: run directory (a local path or a URL such as ``gs://b/run``).
      enabled: False on every process but the first.
    """

    def __init__(self, workdir: str | os.PathLike, *, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._tracker = None
        self._hparams: dict | None = None  # written with the first eval's metric names
        if not enabled:
            return
        directory = self._directory = storage.path(workdir)
        for name in ("metrics.jsonl", HPARAMS_EVENTS):  # found now, not at the first eval
            if (directory / name).is_dir():
                raise UserError(
                    f"{directory / name} is a directory, where the run writes its {name}: "
                    "move it away (or choose another --workdir)"
                )
        self._jsonl = storage.AppendOnlyFile(
            directory / "metrics.jsonl", min_interval_s=_REMOTE_FLUSH_SECS
        )
        self._tb = _tensorboardx().SummaryWriter(logdir=str(directory), flush_secs=30)

    def attach(self, tracker) -> None:
        """Also logs every :meth:`write` to ``tracker`` (``log(step, scalars)`` and
        ``close()``, e.g. :class:`trainer.reporting.tracking.WandbRun`); None = nothing."""
        self._tracker = tracker

    def log_config(self, config) -> None:
        """Records ``config`` as the run's TensorBoard hparams. The HParams plugin
        needs the metric names with them, so they are written with the first
        scalars that include an evaluation (or at :meth:`close`)."""
        if self.enabled:
            self._hparams = flat_hparams(config)

    def _write_hparams(self, tags) -> None:
        # TensorBoard keeps the first hparams it reads of a run, and reads its event
        # files in name order: the config gets a file of its own that sorts first and
        # that each (re)started run rewrites, so it is always the newest run's.
        tbx = _tensorboardx()
        experiment, start, end = tbx.summary.hparams(self._hparams, dict.fromkeys(tags, 0.0))
        out = tbx.record_writer.RecordWriter(str(self._directory / HPARAMS_EVENTS))
        event_pb2 = tbx.proto.event_pb2
        now = time.time()
        out.write(event_pb2.Event(wall_time=now, file_version="brain.Event:2").SerializeToString())
        for summary in (experiment, start, end):
            out.write(event_pb2.Event(wall_time=now, summary=summary).SerializeToString())
        out.close()
        self._hparams = None

    def write(
        self,
        step: int,
        scalars: dict[str, float],
        *,
        window_steps: int | None = None,
        samples: tuple[str, ...] = (),
    ) -> None:
        """Appends one JSON object ``{"step", "time", "window_steps", **scalars}`` (the
        wall-clock time of the row, the steps its training metrics average; only
        ``step`` and scalars when ``window_steps`` is None), TB scalars, the
        evaluation's sample outputs as TensorBoard text (``eval/samples``), and the
        attached tracker's."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        row: dict = {"step": int(step)}
        if window_steps is not None:
            row |= {"time": round(time.time(), 3), "window_steps": int(window_steps)}
        self._jsonl.write(json.dumps(row | clean) + "\n")
        self._jsonl.flush()
        tagged = {tensorboard_tag(k): v for k, v in clean.items()}
        for tag, value in tagged.items():
            self._tb.add_scalar(tag, value, global_step=int(step))
        if samples:
            text = "\n\n".join(f"    {line}" for line in samples)  # markdown code lines
            self._tb.add_text("eval/samples", text, global_step=int(step))
        if self._hparams is not None and any(k.startswith("eval/") for k in clean):
            self._write_hparams(tagged)
        if self._tracker is not None:
            self._tracker.log(int(step), tagged)

    def restart_at(self, step: int) -> None:
        """Tells TensorBoard the run continues from ``step``: it drops the points
        an earlier, killed run logged after it (a ``SessionLog.START`` event)."""
        if not self.enabled:
            return
        event_pb2 = _tensorboardx().proto.event_pb2
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._tb.file_writer.add_event(
            event_pb2.Event(step=int(step) + 1, wall_time=time.time(), session_log=start)
        )

    def progress(
        self,
        step: int,
        total: int,
        scalars: dict[str, float],
        *,
        note: str = "",
        samples: tuple[str, ...] = (),
    ) -> None:
        """One console line: step, loss, learning rate, steps/s and tokens/s, eval
        metrics if any, the time left at the row's rate, then ``note``; then a line per
        sample output."""
        if not self.enabled:
            return
        parts = [f"step {step:>7d}/{total}"]
        for key, label, fmt in (
            ("loss", "loss", ".4f"),
            ("grad_norm", "grad_norm", ".3g"),
            ("learning_rate", "lr", ".3g"),
            ("steps_per_sec", "steps/s", ".2f"),
            ("tokens_per_sec", "tokens/s", ",.0f"),
            ("mfu", "mfu", ".2%"),
        ):
            if key in scalars:
                parts.append(f"{label} {scalars[key]:{fmt}}")
        if "memory/peak_bytes_in_use" in scalars:
            in_use = scalars.get("memory/bytes_in_use", 0.0) / 2**30
            parts.append(
                f"mem {in_use:.2f} GiB (peak {scalars['memory/peak_bytes_in_use'] / 2**30:.2f})"
            )
        parts += [f"{k} {v:.4g}" for k, v in scalars.items() if k.startswith("eval/")]
        if scalars.get("steps_per_sec"):  # none before the first step (eval_at_start)
            eta_s = (total - step) / scalars["steps_per_sec"]
            parts.append(f"ETA {console.duration(eta_s) if math.isfinite(eta_s) else '?'}")
        console.say(" | ".join(parts) + (f" ({note})" if note else ""))
        for sample in samples:
            console.say(f"  sample: {sample}")

    def info(self, message: str) -> None:
        """A plain console message from process 0."""
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flushes and closes the files."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            if self._hparams is not None:  # no evaluation ran: the training loss only
                self._write_hparams(["train/loss"])
            self._tb.close()
        if self._tracker is not None:
            self._tracker.close()


def write_events(directory: str | os.PathLike, step: int, scalars: dict[str, float]) -> None:
    """Writes ``scalars`` at ``step`` as TensorBoard events into ``directory`` (a
    new events file; :func:`tensorboard_tag` names)."""
    with _tensorboardx().SummaryWriter(logdir=str(directory)) as events:
        for key, value in scalars.items():
            events.add_scalar(tensorboard_tag(key), float(value), global_step=int(step))


class LossGrowthWatch:
    """Warns once when a step's loss grows past ``factor`` times the lowest loss of
    the :attr:`WINDOW_STEPS` steps before it: a run diverging to 1e13 may never
    reach NaN, and would otherwise train on without a word.

    Args:
      factor: ``config.loss_growth_warning``; 0 turns the watch off.
    """

    WINDOW_STEPS = 1000

    def __init__(self, factor: float):
        if factor < 0 or (0 < factor <= 1):
            raise ConfigError(f"loss_growth_warning must be > 1 (or 0 = off), got {factor}")
        self._factor = factor
        self._recent: collections.deque[tuple[int, float]] = collections.deque()
        self._warned = False

    def observe(self, first_step: int, losses: np.ndarray, weights: np.ndarray) -> str | None:
        """Takes the per-step losses (and their weights: tokens, examples) of the loop
        after ``first_step``; returns the warning the first time a loss has grown too
        much, else None. Steps of no weight (all padding) are not losses."""
        if not self._factor or self._warned:
            return None
        for i, (loss, weight) in enumerate(zip(losses, weights, strict=True)):
            if weight <= 0:
                continue
            step, loss = first_step + i + 1, float(loss)
            while self._recent and self._recent[0][0] <= step - self.WINDOW_STEPS:
                self._recent.popleft()
            best = min(self._recent, key=lambda item: item[1], default=None)
            self._recent.append((step, loss))
            if best is not None and best[1] > 0 and loss > self._factor * best[1]:
                self._warned = True
                return (
                    f"the loss grew to {loss:.4g} at step {step}, {loss / best[1]:.3g}x its "
                    f"lowest value of the last {self.WINDOW_STEPS} steps ({best[1]:.4g} at step "
                    f"{best[0]}): the run may be diverging (lower the learning rate?); "
                    f"loss_growth_warning={self._factor:g} sets this factor, 0 turns it off"
                )
        return None


class _EpathEventFiles:
    """tensorboardX's hook for a URL scheme: event files opened through etils.epath.

    tensorboardX's own ``gs://`` writer talks to google-cloud-storage directly
    (other URLs fail); this one goes where every other file of the run goes.
    """

    def open(self, location: str) -> storage.AppendOnlyFile:
        # tensorboardX's writer thread already limits flushes to flush_secs.
        return storage.AppendOnlyFile(location, binary=True)

    def directory_check(self, location: str) -> None:
        storage.path(location).mkdir(parents=True, exist_ok=True)


def route_event_files_through_epath() -> None:
    """Registers, process-wide, tensorboardX's writers of ``gs://``, ``s3://`` and
    ``az://`` event files as :class:`_EpathEventFiles` (a command's set-up calls it:
    :func:`trainer.command.process.setup`)."""
    for scheme in ("gs", "s3", "az"):
        _tensorboardx().record_writer.register_writer_factory(scheme, _EpathEventFiles())


class Throughput:
    """Wall-clock rate between two calls of :meth:`lap`."""

    def __init__(self):
        self._last = time.perf_counter()

    def lap(self, steps: int) -> float:
        """Steps per second since the previous lap."""
        now = time.perf_counter()
        rate = steps / max(now - self._last, 1e-9)
        self._last = now
        return rate


# Per-step scalars that describe the state after the window (not its steps): logged
# as their last value. The others (gradient and update norms) are window means.
_LAST_VALUE = ("learning_rate", "param_norm")


def reduce_loop_metrics(
    stacked: dict[str, np.ndarray], step_scalars: tuple[str, ...] = ("learning_rate",)
) -> dict[str, float]:
    """Per-step metrics over a window -> one value each.

    Args:
      stacked: metrics with a leading step dimension: sums over examples
        (including their normaliser ``weight``) and per-step scalars.
      step_scalars: the keys that are per-step values, not sums.

    Returns:
      Sums as sum over the window / total weight; the learning rate and the
      parameter norm of the last step; other per-step scalars (gradient and
      update norms) averaged over the window.
    """
    weight = float(np.sum(stacked["weight"]))
    out = {
        k: float(np.sum(v)) / max(weight, 1e-9)
        for k, v in stacked.items()
        if k != "weight" and k not in step_scalars
    }
    for key in step_scalars:
        if key in stacked:
            values = np.asarray(stacked[key], np.float64)
            out[key] = float(values[-1] if key in _LAST_VALUE else values.mean())
    return out


def device_memory(devices) -> dict[str, float]:
    """Memory of the fullest device among ``devices`` (this process's), in bytes:
    ``memory/bytes_in_use``, ``memory/peak_bytes_in_use`` and ``memory/bytes_limit``
    where the backend reports them (TPU and GPU do; CPU reports nothing: ``{}``)."""
    stats = [s for s in (d.memory_stats() for d in devices) if s]
    out = {}
    for key in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
        values = [s[key] for s in stats if key in s]
        if values:
            out[f"memory/{key}"] = float(max(values))
    return out
