"""What the user sees: a console line, ``metrics.jsonl`` and TensorBoard events.

Only the process that owns the writer (process 0) writes; the others get a
writer with ``enabled=False`` so the training code has no ``if`` around logging.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np


def format_duration(seconds: float) -> str:
    """``3725`` -> ``'1h02m'``; ``75`` -> ``'1m15s'``."""
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class MetricWriter:
    """Writes scalars to ``workdir/metrics.jsonl`` and TensorBoard, and prints
    a progress line.

    Args:
      workdir: run directory.
      enabled: False on every process but the first.
    """

    def __init__(self, workdir: str, *, enabled: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self._jsonl = open(os.path.join(workdir, "metrics.jsonl"), "a")  # noqa: SIM115
        from tensorboardX import SummaryWriter  # noqa: PLC0415  (only process 0 needs it)

        self._tb = SummaryWriter(logdir=workdir, flush_secs=30)

    def write(self, step: int, scalars: dict[str, float]) -> None:
        """Appends one JSON object ``{"step": step, **scalars}`` and TB scalars."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in scalars.items()}
        self._jsonl.write(json.dumps({"step": int(step), **clean}) + "\n")
        self._jsonl.flush()
        for key, value in clean.items():
            self._tb.add_scalar(key, value, global_step=int(step))

    def progress(self, step: int, total: int, scalars: dict[str, float], eta_s: float) -> None:
        """One console line: step, loss, steps/s, ETA (and eval metrics if any)."""
        if not self.enabled:
            return
        parts = [f"step {step:>7d}/{total}"]
        for key, fmt in (("loss", ".4f"), ("steps_per_sec", ".2f"), ("mfu", ".2%")):
            if key in scalars:
                parts.append(f"{key.replace('_per_sec', '/s')} {scalars[key]:{fmt}}")
        parts += [f"{k} {v:.4g}" for k, v in scalars.items() if k.startswith("eval/")]
        parts.append(f"ETA {format_duration(eta_s)}")
        print(" | ".join(parts), flush=True)

    def info(self, message: str) -> None:
        """A plain console message from process 0."""
        if self.enabled:
            print(message, file=sys.stdout, flush=True)

    def close(self) -> None:
        """Flushes and closes the files."""
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


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


def reduce_loop_metrics(stacked: dict[str, np.ndarray]) -> dict[str, float]:
    """Per-step sums over a window -> averages normalised by ``weight``.

    Args:
      stacked: metric sums with a leading step dimension, including ``weight``
        and ``learning_rate``.

    Returns:
      ``loss`` etc. as sum over the window / total weight; the learning rate
      of the last step.
    """
    weight = float(np.sum(stacked["weight"]))
    out = {
        k: float(np.sum(v)) / max(weight, 1e-9)
        for k, v in stacked.items()
        if k not in ("weight", "learning_rate")
    }
    out["learning_rate"] = float(np.asarray(stacked["learning_rate"])[-1])
    return out
