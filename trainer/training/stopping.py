"""Every way out of :func:`trainer.training.train.train`.

:class:`Run` wraps the body of a run: it takes the work-directory lock, tells
every process at each loop boundary whether to stop, and on every way out
(finish, stop, error, NaN, a failed background save, a dead peer) waits for or
abandons the save in flight, stops the data workers, says which checkpoint is
the newest complete one and releases the lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Protocol

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from trainer import checkpoint as checkpoint_lib
from trainer import console
from trainer.errors import UserError
from trainer.workdir import lock as lock_lib


class StopRequests(Protocol):
    """The process's stop requests, as a run reads them: the command's SIGTERM and
    Ctrl-C handling (``trainer.command.signals.Signals``) is one.

    Attributes:
      first: ``"SIGTERM"`` or ``"SIGINT"`` once a stop was asked for, else None.
    """

    first: str | None

    def on_stop_now(
        self, callback: Callable[[str, bool], str | None], last: Callable[[], None] | None = None
    ) -> None:
        """Registers what to do when the process must stop at once (Ctrl-C twice, a
        lost peer): ``callback(why, failed)`` returns what it did, for the last line;
        ``last`` runs after everything else."""


# Stop requests as numbers, to gather them from every process.
_SIGNAL_CODES = {"SIGTERM": 1, "SIGINT": 2}


class NoStopRequests:
    """No stop request ever arrives (a run called from Python: Ctrl-C is Python's own
    KeyboardInterrupt there)."""

    first: str | None = None

    def on_stop_now(self, callback, last=None) -> None:
        """Nothing asks for it."""


class WorkdirLockLostError(UserError):
    """Another run took the work directory over while this one ran."""


class PeerFailedError(UserError):
    """A process of the job failed or left: no save can complete, and the
    threads of the saves in flight would wait for it; the command leaves at once."""

    last_words = True
    exit_at_once = True


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


class Run:
    """The frame of one run (see the module docstring); a context manager.

    Args:
      directory: the work directory.
      signals: the process's stop requests (:class:`StopRequests`).
      lock_timeout_s: ``config.workdir_lock_timeout_s``.
    """

    def __init__(self, directory: epath.Path, signals: StopRequests, *, lock_timeout_s: float):
        self.directory = directory
        self.signals = signals
        self.stopped_at: int | None = None  # the step the run stopped at on request
        # Why it stopped there: "SIGTERM", "SIGINT", or one sent to another process.
        self.stopped_by: str | None = None
        self.trained = False  # whether a training step ran in this process
        self._lock = lock_lib.WorkdirLock(directory, timeout_s=lock_timeout_s)
        self._checkpointer: checkpoint_lib.Checkpointer | None = None
        self._closers: list[Callable[[], None]] = []
        self._lead = jax.process_index() == 0
        # The newest complete checkpoint's path, once the run has ended (None: none).
        self.newest_checkpoint: str | None = None

    # -------------------------------------------------------------- start
    def __enter__(self) -> Run:
        error, taken_over = None, None
        if self._lead:
            try:
                taken_over = self._lock.acquire()
            except lock_lib.WorkdirLockedError as e:
                error = e
        if not checkpoint_lib.all_processes(error is None):
            raise error or lock_lib.WorkdirLockedError(
                f"{self.directory} is in use by another run (process 0 says which)"
            )
        if not self._lead:
            self._lock.join()  # held until this process has finished its part
        if taken_over:
            console.warn(taken_over)
        self.signals.on_stop_now(self._stop_now, last=self._after_stop_now)
        return self

    def watch(self, checkpointer: checkpoint_lib.Checkpointer) -> None:
        """The run's checkpointer: its save in flight is waited for or abandoned."""
        self._checkpointer = checkpointer

    def closes(self, close: Callable[[], None]) -> None:
        """Calls ``close`` on every way out (data workers, metric files), last first."""
        self._closers.append(close)

    # ------------------------------------------------- at loop boundaries
    def should_stop(self) -> bool:
        """Whether every process stops here (all must call this at the same points).

        A stop request on any process (SIGTERM, Ctrl-C, a dead launcher) stops
        every process at this boundary: the flags are gathered from all of them,
        so they agree on the step to save. (JAX's own preemption sync is off in
        the commands, :func:`trainer.command.process.setup` says why.)

        Raises:
          SaveFailedError: a background save failed on some process.
          WorkdirLockLostError: another run took the work directory over.
        """
        failed = self._checkpointer.failure() if self._checkpointer else None
        asked = _SIGNAL_CODES.get(self.signals.first, 0)
        flags = np.array([[asked, self._lock.lost is not None, failed is not None]])
        if jax.process_count() > 1:
            flags = np.asarray(multihost_utils.process_allgather(flags[0])).reshape(-1, 3)
        if flags[:, 2].any():
            raise checkpoint_lib.SaveFailedError(
                failed or "a checkpoint save failed on another process"
            )
        if flags[:, 1].any():
            raise WorkdirLockLostError(
                (self._lock.lost or "another run took over the work directory lock")
                + "; this run stops without saving"
            )
        asking = np.flatnonzero(flags[:, 0])
        if not asking.size:
            return False
        # The first process that was asked names the reason (on every process alike).
        first = int(asking[0])
        name = {code: name for name, code in _SIGNAL_CODES.items()}[int(flags[first, 0])]
        here = jax.process_index()
        self.stopped_by = name if flags[here, 0] else f"{name} to process {first}"
        return True

    # ---------------------------------------------------------------- end
    def __exit__(self, exc_type, exc, tb) -> bool:
        if (
            exc is not None
            and jax.process_count() > 1
            and isinstance(exc, jax.errors.JaxRuntimeError)
        ):
            raise self._after_peer_failure(exc) from exc
        save_error = None
        try:
            if self._checkpointer is not None:
                pending = self._checkpointer.pending
                writing = (
                    console.phase(f"writing the checkpoint of step {pending}")
                    if pending is not None and exc is None
                    else contextlib.nullcontext()
                )
                try:
                    with writing:
                        self._checkpointer.close()
                except checkpoint_lib.SaveFailedError as e:
                    save_error = e
            self._name_the_stop()
            if self._checkpointer is not None and (
                not isinstance(exc, checkpoint_lib.CheckpointError)
                or isinstance(exc, checkpoint_lib.SaveFailedError)
            ):
                self._say(self._ending(exc))
        finally:
            self._close_all()
            # After a clean end the peers are leaving too: their part of the lock goes.
            self._lock.release(wait_for_peers_s=5.0 if exc is None else 0.0)
        if save_error is not None and not isinstance(exc, checkpoint_lib.SaveFailedError):
            if exc is None:
                raise save_error
            console.warn(str(save_error))
        return False

    def _name_the_stop(self) -> None:
        """Names a stop this process first heard of from a peer as its own once the
        same signal has reached it too: a launcher passes a signal on to its processes
        one after another, and a loop boundary can fall between two of them."""
        heard, _, _ = (self.stopped_by or "").partition(" to process ")
        if heard and heard == self.signals.first:
            self.stopped_by = heard

    def _ending(self, exc: BaseException | None, *, listed: bool = True) -> str:
        newest = self._checkpointer.newest(listed=listed) if self._checkpointer else None
        where = self._checkpointer.directory if self._checkpointer else self.directory
        self.newest_checkpoint = None if newest is None else str(where / str(newest))
        tail = (
            f"newest complete checkpoint: step {newest} in {where}"
            if newest is not None
            else f"no complete checkpoint in {where}"
        )
        if exc is not None or self.stopped_at is None:
            return tail
        by = self.stopped_by or self.signals.first or "SIGTERM"
        how = "interrupted (Ctrl-C)" if by == "SIGINT" else "preempted"
        how += f" ({by})" if " to " in by else ""
        again = "; run the same command again to resume" if newest is not None else ""
        if self.stopped_at is None or not self.trained:
            return f"{how} before the first step: nothing new to save; {tail}{again}"
        return f"{how}: saved step {self.stopped_at}; {tail}{again}"

    def _say(self, line: str) -> None:
        if self._lead:
            console.say(line)  # above the live step line, on a terminal

    def _close_all(self) -> None:
        for close in reversed(self._closers):
            with contextlib.suppress(Exception):
                close()
        self._closers = []

    def _after_peer_failure(self, exc: BaseException) -> PeerFailedError:
        """A peer died: no save can complete, and Orbax's threads would wait on
        it (until JAX's coordination service ends the process): abandon the save,
        say so, release the lock; the error tells the command to leave at once."""
        text = ""
        with contextlib.suppress(Exception):
            abandoned = self._checkpointer.abandon() if self._checkpointer else None
            text = f"abandoned the save of step {abandoned}; " if abandoned is not None else ""
        self._close_all()
        with contextlib.suppress(Exception):
            self._say(text + self._ending(exc, listed=False))
        with contextlib.suppress(Exception):
            if self._lead:
                self._lock.release()
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return PeerFailedError(
            f"a process of the job failed or left ({_one_line(first)}); restart the job to resume"
        )

    def _stop_now(self, why: str, failed: bool) -> str:
        """Ctrl-C twice or a lost peer (from another thread, racing the main thread
        until the exit): only what is quick and touches nothing the main thread uses."""
        del why, failed  # the same either way
        if self._checkpointer is None:
            return ""
        abandoned = self._checkpointer.abandon()
        newest = self._checkpointer.newest(listed=False)
        where = self._checkpointer.directory
        parts = [f"abandoned the save of step {abandoned}"] if abandoned is not None else []
        parts.append(
            f"newest complete checkpoint: step {newest} in {where}"
            if newest is not None
            else f"no complete checkpoint in {where}"
        )
        return "; ".join(parts)

    def _after_stop_now(self) -> None:
        if self._lead:
            # The job's other processes are going down too (the same Ctrl-C, or their
            # own watch of the lost peer): their part of the lock goes with them.
            self._lock.release(wait_for_peers_s=3.0)
