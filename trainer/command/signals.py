"""SIGTERM and Ctrl-C: stop requests, and a second Ctrl-C that stops now.

Installed by ``python -m trainer`` before anything slow (this module imports
nothing heavy), for the rest of the process; the run reads it through the
protocol :class:`trainer.training.stopping.StopRequests`. ``train()`` called from
Python installs nothing: there Ctrl-C is Python's own KeyboardInterrupt.

* SIGTERM (a scheduler's notice; ``launch.local`` passing one on) and the first
  SIGINT (Ctrl-C) ask the run to stop at the next loop boundary: it saves,
  waits for the save and exits (0 after SIGTERM, 130 after Ctrl-C).
* A second SIGINT stops now, even inside a long compile: the callbacks the run
  registered abandon the save in flight (its temporary directory removed), stop
  the data workers and release the lock; one line says which checkpoint is the
  newest complete one, and the process exits 130.

A process started by ``launch.local`` (``WUS_LAUNCHER=<pid>:<grace seconds>``
in its environment) gets SIGUSR1 from the kernel when the launcher dies
(``PR_SET_PDEATHSIG``), however it dies. Its output then goes nowhere, so it
goes to /dev/null; the run is asked to stop as after SIGTERM (saving at the
next loop boundary), and whatever is left of the process and its data workers
is killed ``grace`` seconds later: the launcher's processes never outlive it
by more than that. (Before :func:`install`, SIGUSR1 simply ends the process.)

CPython runs Python signal handlers only when the main thread runs Python
again (minutes later inside an XLA compile), so a thread reads the signals from
``signal.set_wakeup_fd``, which the C-level handler writes at once.

SIGINT is blocked in every thread but that reader (threads and processes
inherit the mask of the thread that starts them), so the data workers, which
are in the terminal's process group too, never see a Ctrl-C: the trainer
stops them itself, instead of each dying with a KeyboardInterrupt traceback.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing import resource_tracker

EXIT_INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C
# Set by launch.local for its processes: "<launcher pid>:<grace seconds>".
LAUNCHER_VARIABLE = "WUS_LAUNCHER"
LAUNCHER_DIED = signal.SIGUSR1  # the parent-death signal launch.local asks for


class Signals:
    """The stop requests this process received (see the module docstring)."""

    def __init__(self):
        self.first: str | None = None  # "SIGTERM" or "SIGINT": the first stop request
        self.count = 0  # SIGTERMs and SIGINTs received (two sent at once may arrive as one)
        self._interrupts = 0
        self._stop_now: list[Callable[[str, bool], str | None]] = []
        self._last: list[Callable[[], None]] = []
        self._exiting = threading.Lock()  # one way out at once
        self._local = threading.local()  # which thread took it
        # Seconds a process of launch.local's has after the launcher's death (None: not one).
        self.grace_s: float | None = None

    def on_stop_now(
        self, callback: Callable[[str, bool], str | None], last: Callable[[], None] | None = None
    ) -> None:
        """When the process must stop at once (:meth:`exit_now`: a second Ctrl-C, a lost
        peer), runs ``callback(why, failed)`` (from another thread; its return value
        joins the final line), then prints that line, then runs ``last`` (cleanup that
        must come after everything else, just before the exit)."""
        self._stop_now.append(callback)
        if last is not None:
            self._last.append(last)

    def received(self, signum: int) -> None:
        """Counts one signal (called by the reader thread; tests may call it)."""
        if signum == LAUNCHER_DIED:
            self._launcher_died()
            return
        self.count += 1
        if signum == signal.SIGINT:
            self._interrupts += 1
            if self._interrupts >= 2:
                self.exit_now("Ctrl-C twice", code=EXIT_INTERRUPTED)
        if self.first is None and signum in (signal.SIGTERM, signal.SIGINT):
            self.first = signal.Signals(signum).name
            what = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
            again = " (Ctrl-C again to stop now)" if signum == signal.SIGINT else ""
            _say(f"{what}: saving at the end of the current loop, then stopping{again}")

    def _launcher_died(self) -> None:
        if self.grace_s is None:
            return  # not started by launch.local: not ours to act on
        silence()  # stdout and stderr were pipes to the launcher
        if self.first is None:
            self.first = "SIGTERM"  # stop and save at the next loop boundary
        grace, self.grace_s = self.grace_s, None  # once
        threading.Thread(target=_kill_group_after, args=(grace,), daemon=True).start()

    def wait_if_exiting(self) -> None:
        """Blocks for good if :meth:`exit_now` is under way in another thread: the
        process then ends there, with its line and code (a main thread failing on the
        same cause meanwhile must not say otherwise first)."""
        if self._exiting.locked() and not self._exiting_here():
            threading.Event().wait()

    def _exiting_here(self) -> bool:
        return getattr(self._local, "exiting", False)

    def exit_now(self, why: str, *, code: int, failed: bool = False) -> None:
        """Stops the process now, from any thread: runs the stop-now callbacks, kills
        the data workers, says one line (``stopped now (why): ...``, or ``error: why;
        ...`` when ``failed``), runs the last callbacks and exits with ``code``."""
        if not self._exiting.acquire(blocking=False):
            return  # another way out is under way
        self._local.exiting = True
        parts = []
        for callback in self._stop_now:
            try:
                parts.append(callback(why, failed))
            except Exception as e:  # noqa: BLE001  (going down anyway: say it, go on)
                parts.append(f"({type(e).__name__}: {e})")
        for child in multiprocessing.active_children():  # data workers not stopped above
            child.kill()
        detail = "; ".join(p for p in parts if p)
        if failed:
            _say(f"error: {why}{'; ' + detail if detail else ''}")
        else:
            _say(f"stopped now ({why}){': ' + detail if detail else ''}")
        silence()  # the cleanup below makes the threads still writing fail, loudly
        for last in self._last:
            with contextlib.suppress(Exception):
                last()
        os._exit(code)


def _kill_group_after(seconds: float) -> None:
    """Kills this process and its data workers after ``seconds`` (from a thread)."""
    time.sleep(seconds)
    for child in multiprocessing.active_children():
        child.kill()
    if os.getpgrp() == os.getpid():  # launch.local makes each process a group leader
        os.killpg(os.getpid(), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _launcher(signals: Signals) -> None:
    """Arms the launcher watch if launch.local started this process."""
    value = os.environ.get(LAUNCHER_VARIABLE)
    if not value:
        return
    pid, grace = value.split(":")
    signals.grace_s = float(grace)
    signal.signal(LAUNCHER_DIED, lambda *_: None)  # through the wakeup fd, like the others
    if os.getppid() != int(pid):  # it died before the handler was in place
        signals.received(LAUNCHER_DIED)


def silence() -> None:
    """Sends this process's stdout and stderr to /dev/null from now on: for the
    last moments of a process that has said its last line and exits at once."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(null, 2)


def _say(line: str) -> None:
    """One line on stderr; the reader thread must outlive a closed stderr (a dead launcher)."""
    with contextlib.suppress(OSError):
        print(line, file=sys.stderr, flush=True)


def _interrupted_while_starting(signum, frame) -> None:
    _say("interrupted (Ctrl-C)")
    os._exit(EXIT_INTERRUPTED)  # nothing is written yet: no cleanup to run


def quiet_start() -> None:
    """For a command without the trainer's stop handling: a Ctrl-C while its modules
    import (seconds: JAX, TFDS) ends the process at once with one line and code 130,
    instead of an ImportError-laden traceback. :func:`trainer.command.process.run`
    puts Python's own KeyboardInterrupt back before the command's work starts (which
    then has its ``finally`` blocks to run)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupted_while_starting)


def end_quiet_start() -> None:
    """Puts Python's Ctrl-C (KeyboardInterrupt) back after :func:`quiet_start`."""
    if signal.getsignal(signal.SIGINT) is _interrupted_while_starting:
        signal.signal(signal.SIGINT, signal.default_int_handler)


_installed: tuple[Signals, Callable[[], None]] | None = None


def install() -> Signals:
    """Installs the SIGTERM/SIGINT handling for the rest of the process (idempotent).

    Off the main thread (where signals cannot be handled) the result never fires.
    """
    global _installed
    if _installed is not None:
        return _installed[0]
    signals = Signals()
    if threading.current_thread() is not threading.main_thread():
        return signals
    # multiprocessing unblocks SIGINT in the thread that first starts its
    # resource tracker (CPython's resource_tracker.ensure_running): start it now,
    # and quiet: after Ctrl-C twice it frees what the killed data workers held,
    # with a warning for each kind.
    # The handlers first: a Ctrl-C meanwhile waits in the pipe for the reader thread
    # instead of raising KeyboardInterrupt (the tracker takes a moment to start).
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    options = list(sys.warnoptions)
    sys.warnoptions.append("ignore::UserWarning:multiprocessing.resource_tracker")
    try:
        resource_tracker.ensure_running()
    finally:
        sys.warnoptions[:] = options
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})

    def read() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # the one taker
        while data := os.read(read_fd, 64):
            for signum in data:
                signals.received(signum)
        os.close(read_fd)

    threading.Thread(target=read, name="signals", daemon=True).start()
    _launcher(signals)

    def uninstall() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)
        signal.set_wakeup_fd(previous_fd)
        for s, handler in previous.items():
            signal.signal(s, handler)
        os.close(write_fd)  # the reader sees the end and exits

    _installed = (signals, uninstall)
    return signals


def current() -> Signals | None:
    """The process's stop handling, if a command installed it (:func:`install`)."""
    return _installed[0] if _installed is not None else None
