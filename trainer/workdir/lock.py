"""One live run per work directory: ``DIR/run.lock``.

Two runs writing one work directory lose data (the second resumes from the
first's checkpoint and overwrites its later ones; both append to metrics.jsonl),
so a run holds the lock from start to exit, and a second run stops at once with
one line naming the holder. One job holds it once: process 0 takes it for all
its processes (:func:`trainer.training.stopping.Run` shares the outcome).

* Local directories (and shared file systems with POSIX locks): an exclusive
  ``flock`` on the file. The OS releases it when the holder dies, however it
  dies (kill -9 included), so a dead run's lock is taken over at once.
  Every process of the job also holds a shared ``flock`` on ``run.lock.peers``
  until it has finished its run (:meth:`WorkdirLock.join`): process 0 may end
  first (killed, say) while a peer still writes its part of a save, so a new
  run takes the directory only once no process of the old one is left; it
  waits up to ``timeout_s`` for such stragglers (a job whose launcher died
  ends them within seconds), then stops naming them. Process 0 removes the
  peers file on its way out if no peer holds it any more.
* Object stores: a lease on the lock object, renewed while the run lives, that a
  run taken for dead (not renewed for ``timeout_s``) loses to the next; atomic on
  ``gs://``, best effort elsewhere (:mod:`trainer.workdir.object_lock`).

A run that exits removes its lock; a lock left behind names a run that died.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import socket
import sys
import time
import uuid
from typing import Any

from trainer import console
from trainer.errors import UserError
from trainer.workdir import object_lock, storage

FILE = "run.lock"
PEERS_FILE = "run.lock.peers"


class WorkdirLockedError(UserError):
    """Another live run holds the work directory."""


def holder_info() -> dict[str, Any]:
    """Who this run is, as written into the lock."""
    argv = list(getattr(sys, "orig_argv", sys.argv))  # "python -m trainer ..." as typed
    argv[0] = os.path.basename(argv[0])
    info = {
        "id": uuid.uuid4().hex,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": time.time(),
        "command": " ".join(argv),
    }
    # Started by launch.local ("<launcher pid>:<grace seconds>", trainer/command/signals.py):
    # if that launcher is gone, this process ends within the grace period.
    if launcher := os.environ.get("WUS_LAUNCHER"):
        info["launcher"] = launcher
    return info


def _orphan_grace_s(holder: dict[str, Any] | None) -> float | None:
    """If ``holder`` is a process on this host whose launcher (launch.local) has died,
    the seconds it has left to save and exit; else None."""
    if not holder or holder.get("host") != socket.gethostname():
        return None
    try:
        launcher, grace = str(holder["launcher"]).split(":")
        os.kill(int(launcher), 0)
    except ProcessLookupError:
        return float(grace)  # the launcher is gone: its processes follow within grace
    except (KeyError, ValueError, OSError):
        return None
    return None


def describe(info: dict[str, Any] | None) -> str:
    """``pid 12 on host vm, started 2026-01-02 03:04:05 UTC: python -m trainer ...``."""
    if not info:
        return "a run that is starting up"
    started = datetime.datetime.fromtimestamp(info.get("started", 0), datetime.UTC)
    text = (
        f"pid {info.get('pid')} on host {info.get('host')}, started {started:%Y-%m-%d %H:%M:%S} UTC"
    )
    command = str(info.get("command", ""))
    command = command if len(command) <= 120 else command[:117] + "..."
    return f"{text}: {command}" if command else text


class WorkdirLock:
    """The lock of one work directory (see the module docstring).

    Args:
      directory: the work directory (local path or URL).
      timeout_s: object stores only: a lock not renewed for this long is taken
        for that of a dead run.
    """

    def __init__(self, directory: str | os.PathLike, *, timeout_s: float):
        self.path = storage.path(directory) / FILE
        self.timeout_s = timeout_s
        self.info = holder_info()
        self._fd: int | None = None
        self._peers_fd: int | None = None
        # In an object store: the lease on the lock object (trainer/workdir/object_lock.py).
        self._lease: object_lock.Lease | None = None

    @property
    def lost(self) -> str | None:
        """Why the lock is no longer ours, if another run took it over (object stores)."""
        return self._lease.lost if self._lease is not None else None

    def acquire(self) -> str | None:
        """Takes the lock.

        Returns:
          A message if the lock of a dead run was taken over, else None.

        Raises:
          WorkdirLockedError: naming the live holder.
        """
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if storage.is_remote(self.path):
            self._lease = object_lock.lease(self.path, self.info, self.timeout_s)
            try:
                previous = self._lease.acquire()
            except object_lock.LeaseHeldError as e:
                if e.holder is None and e.renewed_s is None:
                    raise WorkdirLockedError(str(e)) from None
                raise WorkdirLockedError(self._locked_message(e.holder, e.renewed_s)) from None
        else:
            previous = self._acquire_local()
        if previous is None:
            return None
        return (
            "took over the work directory lock of a run that is no longer running "
            f"({describe(previous)})"
        )

    def join(self) -> None:
        """Marks this process (not process 0: :meth:`acquire` does that for it) as one
        of the job holding the lock, until :meth:`release` or its death."""
        if storage.is_remote(self.path):
            return
        import fcntl  # noqa: PLC0415  (POSIX only)

        fd = os.open(os.fspath(self.path.with_name(PEERS_FILE)), os.O_RDWR | os.O_CREAT, 0o644)
        # Shared with this job's other processes; only a run holding run.lock takes
        # it exclusively, and only for a moment, to see that it is free.
        fcntl.flock(fd, fcntl.LOCK_SH)
        self._peers_fd = fd

    def release(self, *, wait_for_peers_s: float = 0.0) -> None:
        """Removes the lock, if it is still ours, and the job's peers file once no peer
        holds it, waiting up to ``wait_for_peers_s`` for them to let go (a clean exit:
        they are leaving too); a peer still running keeps the file."""
        if self._peers_fd is not None:
            os.close(self._peers_fd)  # releases the shared flock
            self._peers_fd = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        if self._fd is not None:
            self._remove_peers_if_free(wait_for_peers_s)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)  # releases the flock
            self._fd = None

    # ----------------------------------------------------------- local file
    def _acquire_local(self) -> dict[str, Any] | None:
        import fcntl  # noqa: PLC0415  (POSIX only)

        path = os.fspath(self.path)
        deadline = None  # set while waiting for the processes of a dead launcher
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = object_lock.parse(os.pread(fd, 1 << 16, 0))
                os.close(fd)
                grace = _orphan_grace_s(holder)
                if grace is not None and deadline is None:
                    deadline = time.monotonic() + grace + 10
                    console.warn(
                        f"{self.path.parent} is held by {describe(holder)}, whose launcher has "
                        f"died: waiting up to {grace + 10:g}s for it to save and exit"
                    )
                if deadline is None or time.monotonic() > deadline:
                    raise WorkdirLockedError(self._locked_message(holder)) from None
                time.sleep(0.2)
                continue
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file as we opened it: try again
                os.close(fd)
                continue
            previous = object_lock.parse(os.pread(fd, 1 << 16, 0))
            try:
                self._peers_fd = self._claim_peers()
            except BaseException:
                os.close(fd)
                raise
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(self.info).encode(), 0)
            os.fsync(fd)
            self._fd = fd
            return previous

    def _claim_peers(self) -> int:
        """Waits (up to ``timeout_s``) until no process of an earlier job holds the
        peers file, then holds it shared for this job; returns its descriptor."""
        import fcntl  # noqa: PLC0415  (POSIX only)

        path = os.fspath(self.path.with_name(PEERS_FILE))
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline, said = time.monotonic() + self.timeout_s, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pids = _flock_holders(fd)
                who = f" (pids {', '.join(map(str, pids))})" if pids else ""
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise WorkdirLockedError(
                        f"{self.path.parent}: processes of an earlier run are still running"
                        f"{who}, {self.timeout_s:g}s after it released the work directory; "
                        "stop them, or choose another --workdir"
                    ) from None
                if not said:
                    console.warn(
                        f"waiting for processes of the previous run in {self.path.parent} to "
                        f"exit{who}"
                    )
                    said = True
                time.sleep(0.2)
        # Shared from now on, with this job's other processes (join). Not atomic, but
        # only a holder of run.lock (this process) ever asks for it exclusively.
        fcntl.flock(fd, fcntl.LOCK_SH)
        return fd

    def _remove_peers_if_free(self, wait_s: float) -> None:
        """Removes the peers file once no process of the job holds it (waiting up to
        ``wait_s``); a straggler keeps it, for the next run to wait on. Safe while
        this process holds run.lock: only a holder of run.lock creates the file."""
        import fcntl  # noqa: PLC0415  (POSIX only)

        path = os.fspath(self.path.with_name(PEERS_FILE))
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            return
        deadline = time.monotonic() + wait_s
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a peer is still running
                    if time.monotonic() >= deadline:
                        return
                    time.sleep(0.05)
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return
        finally:
            os.close(fd)

    def _locked_message(self, holder: dict[str, Any] | None, renewed_s: float | None = None) -> str:
        text = f"{self.path.parent} is in use by another run ({describe(holder)})"
        if renewed_s is not None:
            text += (
                f"; its lock was renewed {renewed_s:.0f}s ago (a lock not renewed for "
                f"workdir_lock_timeout_s={self.timeout_s:g}s is taken over)"
            )
        return text + "; wait for it to end, stop it, or choose another --workdir"


def _flock_holders(fd: int) -> list[int]:
    """Pids holding flocks on ``fd``'s file, from Linux's /proc/locks ([] elsewhere)."""
    stat = os.fstat(fd)
    inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return []
    me = os.getpid()
    return sorted(
        {int(r[4]) for r in rows if len(r) > 5 and r[1] == "FLOCK" and r[5] == inode} - {me}
    )
