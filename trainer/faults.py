"""Deterministic fault injection, for the fault tests and the soak script; off unless asked.

``WUS_FAULT=<point>:<action>[:<n>]`` makes the run do ``<action>`` the ``n``-th
time (default 1) it passes ``<point>``. Without the variable :func:`point` is a
dictionary lookup that does nothing.

Points (where the trainer calls :func:`point`):

* ``compile``: just before a training loop is compiled;
* ``loop``: a compiled loop has been dispatched and is running on the devices;
* ``save``: inside a checkpoint save, in its background writer, while the
  step's temporary directory exists and before it is committed;
* ``eval``: between two evaluation batches;
* ``export``: inside ``trainer.export``, after the weights are written and before
  the export is complete.

Actions: ``kill`` (SIGKILL to this process), ``term`` (SIGTERM), ``int`` (one
SIGINT, as a first Ctrl-C), ``int2`` (two SIGINTs, Ctrl-C twice), ``stop``
(SIGSTOP: the process freezes where it is until a SIGCONT, e.g. with a save's
temporary directory in place for a reader to meet), ``enospc`` (raise
``OSError(ENOSPC)``, as a full disk does).
"""

from __future__ import annotations

import errno
import os
import signal
import threading
import time

from trainer.errors import ConfigError

VARIABLE = "WUS_FAULT"
POINTS = ("compile", "loop", "save", "eval", "export")
ACTIONS = ("kill", "term", "int", "int2", "stop", "enospc")

_passes: dict[str, int] = {}
_lock = threading.Lock()


def parse(text: str) -> tuple[str, str, int]:
    """``"save:kill:2"`` -> ``("save", "kill", 2)``; ConfigError if malformed."""
    parts = text.split(":")
    nth = parts[2] if len(parts) == 3 else "1"
    if (
        len(parts) not in (2, 3)
        or parts[0] not in POINTS
        or parts[1] not in ACTIONS
        or not nth.isdigit()
        or int(nth) < 1
    ):
        raise ConfigError(
            f"{VARIABLE}={text!r}: expected <point>:<action>[:<n>] with a point of "
            f"{', '.join(POINTS)}, an action of {', '.join(ACTIONS)} and n >= 1 "
            f"(or unset {VARIABLE}: it injects faults for tests)"
        )
    return parts[0], parts[1], int(nth)


def check() -> None:
    """Raises ConfigError now if ``WUS_FAULT`` is set but malformed (rather than at
    the first point it would be asked about, minutes into a run)."""
    if spec := os.environ.get(VARIABLE):
        parse(spec)


def point(name: str) -> None:
    """Does the configured action if this is the chosen pass through ``name``."""
    spec = os.environ.get(VARIABLE)
    if not spec:
        return
    where, action, nth = parse(spec)
    if where != name:
        return
    with _lock:
        _passes[name] = _passes.get(name, 0) + 1
        if _passes[name] != nth:
            return
    if action == "enospc":
        raise OSError(errno.ENOSPC, f"No space left on device (injected by {VARIABLE}={spec})")
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once continued
        return
    signals = {
        "kill": [signal.SIGKILL],
        "term": [signal.SIGTERM],
        "int": [signal.SIGINT],
        "int2": [signal.SIGINT, signal.SIGINT],
    }[action]
    for signum in signals:
        os.kill(os.getpid(), signum)
        # A signal sent while the same one is still pending is lost: wait until a
        # thread has taken it (the command's handler, or the default action).
        deadline = time.monotonic() + 10
        while signum in signal.sigpending() and time.monotonic() < deadline:
            time.sleep(0.001)
