"""The training figures of one metrics row: the compiled loops since the last row,
reduced to a loss, norms, rates, MFU and memory (:class:`LogWindow`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
import numpy as np

from trainer.reporting import metrics


class LogWindow:
    """Collects the per-step metrics of the loops since the last row and makes the row.

    Training throughput counts only the time between :meth:`restart_clock` (after a
    compile or an evaluation) and the row: evaluation time is not training time.

    Args:
      first_step: the step the window starts after.
      global_batch_size: examples per step.
      step_scalars: the per-step values among the loop's metrics (not sums).
      flops_per_example: model FLOPs of one training example (0: no MFU).
      peak_flops: peak FLOP/s of all devices together (0: no MFU).
      counts_tokens: the loop's ``weight`` counts tokens: report tokens/s.
      resumed_at: the step a resume started from (None: not a resume), so that the
        first row after it can say it averages fewer steps.
    """

    def __init__(
        self,
        first_step: int,
        *,
        global_batch_size: int,
        step_scalars: Sequence[str],
        flops_per_example: float,
        peak_flops: float,
        counts_tokens: bool,
        resumed_at: int | None = None,
    ):
        self._start = first_step
        self._batch, self._step_scalars = global_batch_size, tuple(step_scalars)
        self._flops, self._peak, self._tokens = flops_per_example, peak_flops, counts_tokens
        self._resumed_at = resumed_at
        self._loops: list[dict] = []
        self._steps = 0  # steps timed since the clock last restarted
        self._clock = time.perf_counter()

    def restart_clock(self) -> None:
        """Training time counts from now (after a compile or an evaluation)."""
        self._clock, self._steps = time.perf_counter(), 0

    def add(self, loop_metrics: dict[str, np.ndarray], steps: int) -> None:
        """One compiled loop's per-step metrics (host arrays with a leading step dim)."""
        self._loops.append(loop_metrics)
        self._steps += steps

    def row(self, step: int, devices: Sequence[jax.Device]) -> tuple[dict[str, float], int]:
        """The row at ``step``: ``(scalars, window_steps)``, the steps the training
        figures average. Starts the next window."""
        now = time.perf_counter()
        rate = self._steps / max(now - self._clock, 1e-9)
        self._clock, self._steps = now, 0
        stacked = {key: np.concatenate([w[key] for w in self._loops]) for key in self._loops[0]}
        self._loops = []
        scalars = metrics.reduce_loop_metrics(stacked, self._step_scalars)
        examples_per_sec = rate * self._batch
        scalars |= {"steps_per_sec": rate, "examples_per_sec": examples_per_sec}
        scalars["step_time_s"] = 1.0 / max(rate, 1e-9)
        scalars |= metrics.device_memory(devices)
        if self._peak:
            scalars["mfu"] = self._flops * examples_per_sec / self._peak
        if self._tokens:
            seconds = len(stacked["weight"]) / max(rate, 1e-9)
            scalars["tokens_per_sec"] = float(np.sum(stacked["weight"])) / max(seconds, 1e-9)
        window_steps, self._start = step - self._start, step
        return scalars, window_steps

    def note(self, step: int, window_steps: int, log_every: int) -> str:
        """What the console line of a row adds: that the first row after a resume
        averages only the steps since it (when fewer than ``log_every``)."""
        since_resume = self._resumed_at is not None and step - window_steps == self._resumed_at
        if since_resume and window_steps < log_every:
            return f"over the {window_steps} steps since the resume"
        return ""
