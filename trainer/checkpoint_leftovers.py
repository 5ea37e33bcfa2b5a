"""Removing what an unfinished save left, while its writer threads may still write.

A failed or abandoned Orbax save leaves a temporary directory whose writer
threads keep adding files (and directories) until they fail or their process
exits. Which paths those are is the caller's to say (a glob pattern in a
directory: :class:`trainer.checkpoint.Checkpointer` owns the layout); this
module only removes them, now or once this process has exited.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

from etils import epath

from trainer import storage

# The helper of remove_after_exit: argv = [pid, glob pattern].
_REMOVE_AFTER_EXIT = """
import glob, os, shutil, sys, time
pid, pattern = int(sys.argv[1]), sys.argv[2]
deadline = time.time() + 120
while time.time() < deadline:
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # exited; its parent has not reaped it yet
    except FileNotFoundError:
        break
    except OSError:  # no /proc: ask the process table
        try:
            os.kill(pid, 0)
        except OSError:
            break
    time.sleep(0.02)
for path in glob.glob(pattern):
    shutil.rmtree(path, ignore_errors=True)
"""


def _remove(path: epath.Path) -> None:
    with contextlib.suppress(OSError):  # a writer added a file meanwhile
        if path.is_dir():
            path.rmtree(missing_ok=True)
        else:
            path.unlink(missing_ok=True)


def remove_until_quiet(directory: epath.Path, pattern: str) -> None:
    """Removes the paths matching ``pattern`` in ``directory`` until none has
    reappeared for 0.3s, for at most 10s (writers may re-create them meanwhile).

    Args:
      directory: where to look.
      pattern: a glob pattern of names in ``directory``.
    """
    deadline, quiet = time.monotonic() + 10, 0
    while quiet < 3 and time.monotonic() < deadline:
        paths = list(directory.glob(pattern))
        quiet = 0 if paths else quiet + 1
        for path in paths:
            _remove(path)
        time.sleep(0.1)


def remove_after_exit(directory: epath.Path, pattern: str) -> None:
    """Removes the paths matching ``pattern`` in ``directory`` once this process has
    exited: writer threads die with it, and until then may re-create what is
    removed. A small helper process waits for this one to end, then removes them.
    In an object store, one pass now.

    Args:
      directory: where to look.
      pattern: a glob pattern of names in ``directory``.
    """
    if storage.is_remote(directory):
        for path in directory.glob(pattern):
            _remove(path)
        return
    subprocess.Popen(
        [
            sys.executable,
            "-S",
            "-c",
            _REMOVE_AFTER_EXIT,
            str(os.getpid()),
            os.path.join(os.fspath(directory), pattern),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # a second Ctrl-C to the terminal's group spares it
    )
