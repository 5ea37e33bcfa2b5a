"""What of Orbax's output reaches the user (trainer/orbax_output.py)."""

import logging
import os
import sys
import types

from trainer import orbax_output


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


def test_orbax_warnings_dropped_only_while_probing():
    drop = orbax_output._DropErrors()

    def record(level, path="/x/orbax/checkpoint/manager.py", msg="broken"):
        return logging.LogRecord("absl", level, path, 1, msg, None, None)

    assert drop.filter(record(logging.WARNING))
    assert not drop.filter(record(logging.ERROR))
    assert drop.filter(record(logging.ERROR, path="/x/trainer/train.py"))
    with orbax_output.probing():
        assert not drop.filter(record(logging.WARNING))
        assert drop.filter(record(logging.INFO))
    assert drop.filter(record(logging.WARNING))
    assert not drop.filter(
        record(logging.ERROR, "/x/asyncio/base.py", "exception was never retrieved")
    )
