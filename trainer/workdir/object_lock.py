"""The work-directory lock in an object store: a lease on ``DIR/run.lock`` that the
holder renews, and that a run not renewing it for ``timeout_s`` loses (the local
``flock`` protocol and the rest of the lock: :mod:`trainer.workdir.lock`).

* ``gs://``: the lock is an object created only if absent (the
  ``ifGenerationMatch=0`` precondition); the holder renews it every quarter of
  ``timeout_s``, each time only if it still has the generation the holder wrote,
  and learns so if another run took it over. A lock not renewed for ``timeout_s``
  (by the object store's clock, against this host's) is that of a dead run; it is
  replaced only if unchanged since it was read, so of two runs racing for it
  exactly one wins.
* Other object stores (``s3://``, ``az://``): no atomic create through etils here;
  the lock is written and rewritten (best effort, said in a warning).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from etils import epath

from trainer import console


class LeaseHeldError(Exception):
    """A live run holds the lease (the work-directory lock turns this into its error).

    Attributes:
      holder: the holder's content (:func:`parse`), None if unreadable.
      renewed_s: seconds since the holder last renewed it (None: unknown).
    """

    def __init__(self, holder: dict[str, Any] | None, renewed_s: float | None, detail: str = ""):
        super().__init__(detail or "held by another run")
        self.holder, self.renewed_s = holder, renewed_s


def parse(data: bytes) -> dict[str, Any] | None:
    """A lock's content (``trainer.workdir.lock.holder_info``), or None where it
    cannot be read."""
    try:
        info = json.loads(data.decode())
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return info if isinstance(info, dict) else None


class Lease:
    """A lease on the lock object ``path``, renewed in a thread while held.

    Attributes:
      lost: why the lease is no longer ours (another run took it over), else None.
    """

    def __init__(self, path: epath.Path, info: dict[str, Any], timeout_s: float):
        self.path, self.info, self.timeout_s = path, info, timeout_s
        self.lost: str | None = None
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> dict[str, Any] | None:
        """Takes the lease; returns the holder of a dead run taken over (else None).

        Raises:
          LeaseHeldError: a live run holds it.
        """
        raise NotImplementedError

    def release(self) -> None:
        """Stops renewing and removes the lock object, if it is still ours."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=30)
            self._renewer = None

    def _renew_every(self, renew: Callable[[], None]) -> None:
        def loop() -> None:
            while not self._stop.wait(self.timeout_s / 4) and self.lost is None:
                renew()

        self._renewer = threading.Thread(target=loop, name="workdir-lock", daemon=True)
        self._renewer.start()


class GcsLease(Lease):
    """A lease on ``gs://`` with the generation preconditions of the GCS JSON API."""

    def __init__(self, path: epath.Path, info: dict[str, Any], timeout_s: float):
        super().__init__(path, info, timeout_s)
        self._generation: str | None = None

    def acquire(self) -> dict[str, Any] | None:
        store = _GcsObject(self.path)
        body = json.dumps(self.info).encode()
        previous = None
        for _ in range(10):
            current = store.read()
            try:
                if current is None:
                    self._generation = store.write(body, if_generation="0")
                else:
                    generation, updated, holder = current
                    if holder and holder.get("id") == self.info["id"]:
                        self._generation = generation  # our own retried create
                    elif time.time() - updated < self.timeout_s:
                        raise LeaseHeldError(holder, time.time() - updated)
                    else:
                        self._generation = store.write(body, if_generation=generation)
                        previous = holder or {}
            except FileExistsError:
                continue  # changed since read: look again
            break
        if self._generation is None:
            raise LeaseHeldError(None, None, f"could not take {self.path}: it keeps changing")
        self._renew_every(lambda: self._renew(store))
        return previous

    def _renew(self, store: _GcsObject) -> None:
        try:
            self._generation = store.write(
                json.dumps(self.info).encode(), if_generation=self._generation
            )
        except (FileExistsError, FileNotFoundError):
            self.lost = f"another run took over the work directory lock {self.path}"
        except Exception as e:  # noqa: BLE001  (a network hiccup: try again next time)
            console.warn(f"could not renew {self.path}: {e}")

    def release(self) -> None:
        super().release()
        if self._generation is not None and self.lost is None:
            # Taken over meanwhile (FileExistsError): not ours to remove.
            with contextlib.suppress(FileExistsError, FileNotFoundError):
                _GcsObject(self.path).delete(self._generation)
        self._generation = None


class BestEffortLease(Lease):
    """A lease written and rewritten, for object stores without an atomic create here."""

    def __init__(self, path: epath.Path, info: dict[str, Any], timeout_s: float):
        super().__init__(path, info, timeout_s)
        self._held = False

    def acquire(self) -> dict[str, Any] | None:
        console.warn(
            f"{self.path}: this object store has no atomic create here; the work directory "
            "lock is best effort"
        )
        previous = None
        if self.path.exists():
            previous = parse(self.path.read_bytes()) or {}
            age = time.time() - self.path.stat().mtime
            if age < self.timeout_s:
                raise LeaseHeldError(previous, age)
        self.path.write_text(json.dumps(self.info))
        self._held = True
        self._renew_every(lambda: self.path.write_text(json.dumps(self.info)))
        return previous

    def release(self) -> None:
        super().release()
        if self._held:
            self.path.unlink(missing_ok=True)
            self._held = False


def lease(path: epath.Path, info: dict[str, Any], timeout_s: float) -> Lease:
    """The lease for the lock object ``path``: atomic on ``gs://``, best effort elsewhere."""
    cls = GcsLease if str(path).startswith("gs://") else BestEffortLease
    return cls(path, info, timeout_s)


class _GcsObject:
    """One ``gs://`` object with the generation preconditions of the GCS JSON API."""

    def __init__(self, path: epath.Path):
        import fsspec  # noqa: PLC0415

        self._fs = fsspec.filesystem("gs")
        self._bucket, self._key = str(path).split("://", 1)[1].split("/", 1)

    def read(self) -> tuple[str, float, dict[str, Any] | None] | None:
        """``(generation, updated unix time, content)``, or None if absent."""
        try:
            meta = self._fs.call("GET", "b/{}/o/{}", self._bucket, self._key, json_out=True)
            _, data = self._fs.call(
                "GET",
                "b/{}/o/{}",
                self._bucket,
                self._key,
                alt="media",
                generation=meta["generation"],
            )
        except FileNotFoundError:
            return None
        updated = datetime.datetime.fromisoformat(meta["updated"].replace("Z", "+00:00"))
        return str(meta["generation"]), updated.timestamp(), parse(data)

    def write(self, body: bytes, *, if_generation: str) -> str:
        """Writes if the object's generation is ``if_generation`` ("0": absent);
        returns the new generation. FileExistsError if the precondition fails."""
        out = self._fs.call(
            "POST",
            f"{self._fs._location}/upload/storage/v1/b/{{}}/o",
            self._bucket,
            uploadType="media",
            name=self._key,
            ifGenerationMatch=if_generation,
            data=body,
            headers={"Content-Type": "application/octet-stream"},
            json_out=True,
        )
        return str(out["generation"])

    def delete(self, generation: str) -> None:
        """Deletes if the object still has ``generation``."""
        self._fs.call("DELETE", "b/{}/o/{}", self._bucket, self._key, ifGenerationMatch=generation)
