"""``profile_steps``: a device and host trace of some training steps, for
TensorBoard's profile plugin (xprof).

``profile_steps = (first, count)`` traces steps ``first + 1`` ... ``first + count``.
Steps run in compiled loops of ``steps_per_loop`` and Python only sees loop
boundaries, so both numbers must be multiples of it (for a few steps, shorten
the loop: ``--config.steps_per_loop=5 --config.profile_steps=10,5``). Each loop
is marked as a step (``StepTraceAnnotation``), so the plugin's overview shows
loop times. The trace is written under ``<workdir>/profile/plugins/profile/<time>/``
(one ``.xplane.pb`` per host, and a ``.trace.json.gz`` beside it);
``tensorboard --logdir <workdir>`` shows it in its Profile tab (with
``tensorboard-plugin-profile`` installed), ui.perfetto.dev the JSON, and
``scripts/op_times.py`` sums the compiled ops' times from it. For a ``gs://``
workdir the trace is written locally and copied.
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import tempfile
from collections.abc import Callable

import jax
from etils import epath

from trainer.errors import ConfigError
from trainer.workdir import storage


class StepProfiler:
    """Starts and stops the trace at loop boundaries.

    Args:
      profile_steps: ``()`` (no trace) or ``(first, count)``.
      steps_per_loop: the loop length K.
      workdir: the run directory.
      log: prints a message (process 0).
    """

    def __init__(
        self,
        profile_steps: tuple[int, ...],
        *,
        steps_per_loop: int,
        workdir: epath.Path,
        log: Callable[[str], None],
    ):
        self._log = log
        self.directory = workdir / "profile"
        self._local: str | None = None  # where the running trace is written
        self._span: tuple[int, int] | None = None
        if not profile_steps:
            return
        if len(profile_steps) != 2:
            raise ConfigError(f"profile_steps must be (first, count) or (), got {profile_steps}")
        first, count = (int(x) for x in profile_steps)
        k = steps_per_loop
        if first < 0 or count < 1 or first % k or count % k:
            raise ConfigError(
                f"profile_steps=({first}, {count}): the first step must be >= 0 and the count "
                f">= 1, both multiples of steps_per_loop={k} (the trace starts and stops "
                f"between compiled loops); e.g. --config.steps_per_loop="
                f"{_common_loop(first, count)}"
            )
        self._span = (first, first + count)

    def at_boundary(self, step: int) -> None:
        """Called when ``step`` steps are done and no loop is running."""
        if self._span is None:
            return
        first, end = self._span
        if step == first and self._local is None:
            remote = storage.is_remote(self.directory)
            self._local = tempfile.mkdtemp(prefix="profile-") if remote else str(self.directory)
            # Also as a Perfetto trace (``*.trace.json.gz``): ui.perfetto.dev shows it,
            # and it is plain JSON (scripts/op_times.py sums it), where the .xplane.pb
            # needs TensorBoard's profile plugin (the ``[profile]`` extra).
            jax.profiler.start_trace(self._local, create_perfetto_trace=True)
        elif step >= end:
            self.stop(step)

    def annotate(self, step: int) -> contextlib.AbstractContextManager:
        """Marks one compiled loop (starting after ``step`` steps) in the trace."""
        return jax.profiler.StepTraceAnnotation("train_loop", step_num=step)

    def stop(self, step: int) -> None:
        """Ends a running trace after ``step`` steps and says where it is."""
        if self._local is None:
            return
        jax.profiler.stop_trace()
        first, _ = self._span
        size = sum(
            os.path.getsize(os.path.join(root, f))
            for root, _, files in os.walk(self._local)
            for f in files
        )
        if storage.is_remote(self.directory):
            _copy_tree(self._local, self.directory)
            shutil.rmtree(self._local, ignore_errors=True)
        self._local, self._span = None, None
        self._log(
            f"profile of steps {first + 1}-{step} ({size / 2**20:.1f} MiB) in {self.directory}: "
            f"pip install -e '.[profile]'; tensorboard --logdir {self.directory.parent}"
        )


def _common_loop(first: int, count: int) -> int:
    """The largest loop length dividing both numbers (for the error message)."""
    return math.gcd(first, count) or count


def _copy_tree(local: str, target: epath.Path) -> None:
    for root, _, files in os.walk(local):
        for name in files:
            source = os.path.join(root, name)
            destination = target / os.path.relpath(source, local)
            destination.parent.mkdir(parents=True, exist_ok=True)
            with open(source, "rb") as f:
                destination.write_bytes(f.read())
