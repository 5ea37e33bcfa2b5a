"""What of Orbax's output reaches the user.

Orbax logs the errors of its background threads with tracebacks, and warns
about every broken file while a checkpoint is probed; the same problems reach
the run through :class:`trainer.checkpoint.checkpointer.Checkpointer`, which reports each
once, in one line. So :func:`quiet` drops those records, the tracebacks
TensorStore prints (through either hook) for writes that end after their save
failed, and those of Orbax's read coroutines that are collected after a restore
failed; and
:func:`one_line` and :func:`write_error` make that one line of an Orbax error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
from collections.abc import Iterator


class _DropErrors(logging.Filter):
    """Drops Orbax's error records (tracebacks of its background threads), its
    warnings while a restore probes checkpoints, and asyncio's "exception was
    never retrieved" about its futures: the same problems reach the run through
    the Checkpointer, which reports each once."""

    def filter(self, record: logging.LogRecord) -> bool:
        level = logging.WARNING if _probing.count else logging.ERROR
        if record.levelno >= level and "/orbax/" in record.pathname:
            return False
        return "exception was never retrieved" not in str(record.msg)


# What a failed write says when the disk, not the program, is at fault.
_DISK_ERRORS = "No space left on device|Disk quota exceeded|Permission denied|Read-only file system"


def one_line(error: BaseException, limit: int = 300) -> str:
    """``error``'s message in one line of at most ``limit`` characters."""
    text = " ".join(str(error).split()) or type(error).__name__
    text = text.split(" See full TensorStore details")[0]  # a repr of the whole spec follows
    return text if len(text) <= limit else text[: limit - 3] + "..."


def write_error(error: BaseException) -> str:
    """A failed write in one line, its cause first when the disk is at fault."""
    cause = re.search(_DISK_ERRORS, str(error))
    return f"{cause.group(0)} ({one_line(error, 200)})" if cause else one_line(error)


@contextlib.contextmanager
def probing() -> Iterator[None]:
    """Orbax's warnings are dropped meanwhile (see _DropErrors); nests (a restore
    lists the steps, which probes too)."""
    with _probing.lock:
        _probing.count += 1
    try:
        yield
    finally:
        with _probing.lock:
            _probing.count -= 1


class _Probing:
    """How many :func:`probing` blocks are open, in any thread (the filters are the
    process's, installed once by :func:`quiet`)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.count = 0


_probing = _Probing()


def quiet() -> None:
    """Installs the filters and hooks (idempotent; :func:`trainer.command.process.setup`
    calls it: the process's, not the library's)."""
    for name in ("absl", "asyncio"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropErrors) for f in logger.filters):
            logger.addFilter(_DropErrors())
    if not getattr(sys.excepthook, "drops_closed_loop_callbacks", False):
        sys.excepthook = _drop_closed_loop_callbacks(sys.excepthook)
    if not getattr(sys.unraisablehook, "drops_orbax_coroutines", False):
        sys.unraisablehook = _drop_orbax_coroutines(sys.unraisablehook)


def _closed_loop_callback(kind, value, tb) -> bool:
    """Whether an uncaught error is a TensorStore completion that ended after its
    save failed: Orbax's event loop is closed by then, so ``call_soon_threadsafe``
    raises. TensorStore reports each one through ``sys.excepthook`` or, from its
    own threads, ``sys.unraisablehook`` (without an object, so Python prints a bare
    traceback). The failure itself reaches the run once (:meth:`Checkpointer.failure`)."""
    last = tb
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    return (
        kind is RuntimeError
        and str(value) == "Event loop is closed"
        and last is not None
        and last.tb_frame.f_code.co_filename.endswith(os.path.join("asyncio", "base_events.py"))
    )


def _drop_closed_loop_callbacks(hook):
    """``sys.excepthook`` without :func:`_closed_loop_callback` tracebacks."""

    def excepthook(kind, value, tb):
        if not _closed_loop_callback(kind, value, tb):
            hook(kind, value, tb)

    excepthook.drops_closed_loop_callbacks = True
    return excepthook


def _drop_orbax_coroutines(hook):
    """``sys.unraisablehook`` without Orbax's read coroutines and without
    :func:`_closed_loop_callback` tracebacks. When one array of a broken checkpoint
    fails to read, the reads of its other shards fail too and are collected
    unawaited, each printing "Exception ignored in" with a traceback, at a time
    that depends on the garbage collector. The failure itself reaches the run
    once, as the checkpoint being unreadable."""

    def unraisablehook(unraisable):
        code = getattr(unraisable.object, "cr_code", None)
        if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
            return
        if _closed_loop_callback(
            unraisable.exc_type,
            getattr(unraisable, "exc_value", None),
            getattr(unraisable, "exc_traceback", None),
        ):
            return
        hook(unraisable)

    unraisablehook.drops_orbax_coroutines = True
    return unraisablehook
