"""What of Orbax's output reaches the user (trainer/checkpoint/orbax_output.py)."""

import asyncio
import logging
import os
import sys
import types

from trainer.checkpoint import orbax_output


def coroutine_from(filename: str):
    """A coroutine whose code reports ``filename``, as Orbax's read coroutines do."""
    namespace = {}
    exec(compile("async def read():\n    pass\n", filename, "exec"), namespace)
    return namespace["read"]()


def test_unraisable_hook_drops_only_orbax_coroutines(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.object))
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    orbax_output.quiet()

    orbax = coroutine_from(os.path.join("site-packages", "orbax", "serialization.py"))
    other = coroutine_from(os.path.join("site-packages", "mine", "reader.py"))
    for obj in (orbax, other, "not a coroutine"):
        sys.unraisablehook(types.SimpleNamespace(object=obj, exc_type=ValueError))
    assert seen == [other, "not a coroutine"]
    orbax.close()
    other.close()


def closed_loop_error() -> RuntimeError:
    """The error a TensorStore completion meets on Orbax's closed event loop."""
    loop = asyncio.new_event_loop()
    loop.close()
    try:
        loop.call_soon_threadsafe(lambda: None)
    except RuntimeError as e:
        return e
    raise AssertionError("a closed loop accepted a callback")


def test_closed_loop_callbacks_dropped_from_both_hooks(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(("unraisable", u.exc_value)))
    monkeypatch.setattr(sys, "excepthook", lambda k, v, tb: seen.append(("except", v)))
    orbax_output.quiet()

    closed = closed_loop_error()
    other = RuntimeError("Event loop is closed")  # raised elsewhere: no asyncio frame
    for error in (closed, other):
        # TensorStore's threads report through the unraisable hook, without an object.
        sys.unraisablehook(
            types.SimpleNamespace(
                object=None,
                exc_type=type(error),
                exc_value=error,
                exc_traceback=error.__traceback__,
            )
        )
        sys.excepthook(type(error), error, error.__traceback__)
    assert seen == [("unraisable", other), ("except", other)]


def test_orbax_warnings_dropped_only_while_probing():
    drop = orbax_output._DropErrors()

    def record(level, path="/x/orbax/checkpoint/manager.py", msg="broken"):
        return logging.LogRecord("absl", level, path, 1, msg, None, None)

    assert drop.filter(record(logging.WARNING))
    assert not drop.filter(record(logging.ERROR))
    assert drop.filter(record(logging.ERROR, path="/x/trainer/training/train.py"))
    with orbax_output.probing():
        assert not drop.filter(record(logging.WARNING))
        assert drop.filter(record(logging.INFO))
    assert drop.filter(record(logging.WARNING))
    assert not drop.filter(
        record(logging.ERROR, "/x/asyncio/base.py", "exception was never retrieved")
    )
