"""Where a run's files live: a local directory or an object store (``gs://``, ``s3://``, ``az://``).

Every path a run reads or writes (work directory, checkpoints, metrics,
TensorBoard events, exports, datasets, vocabularies, the compilation cache)
is an ``etils.epath.Path``; epath reads and writes ``gs://`` through gcsfs,
Orbax writes arrays through TensorStore, and both understand the same URLs.

``STORAGE_EMULATOR_HOST=http://127.0.0.1:PORT`` (the variable Google's client
libraries read) points the whole run at a local GCS emulator; :func:`configure`
passes it on to the libraries that have their own names for it.
"""

from __future__ import annotations

import errno
import functools
import math
import os
import socket
import threading
import time

from etils import epath

from trainer.errors import ConfigError, UserError

# The file-system errors a user's paths or machine cause (not bugs), each with what
# it means for the path and what to do about it (:func:`explain`).
_PATH_ERRORS = {
    errno.ENOTDIR: "move that file away or choose another path",
    errno.ELOOP: "its symbolic links form a loop: fix them or choose another path",
    errno.ENAMETOOLONG: "a name in it is longer than the file system allows: choose shorter names",
    errno.EISDIR: "give the name of a file, not of a directory",
    errno.EEXIST: "remove it or choose another path",
    errno.ENOENT: "create it first or choose another path",
    errno.ENOSPC: "free some space or choose another disk",
    errno.EDQUOT: "free some space or raise the quota",
    errno.EROFS: "choose a writable path",
    errno.EACCES: "change the permissions or choose another path",
    errno.EPERM: "change the permissions or choose another path",
}
PATH_ERRNOS = frozenset(_PATH_ERRORS)


class PathError(UserError):
    """A path the user gave cannot be used (a file where a directory should be, ...)."""


def _file_among_parents(location: str) -> str | None:
    """The first of ``location``'s parents that exists and is not a directory."""
    parts = os.path.abspath(location).split(os.sep)
    for i in range(2, len(parts)):
        parent = os.sep.join(parts[:i])
        if os.path.lexists(parent) and not os.path.isdir(parent):
            return parent
    return None


def _dangling_link(location: str) -> str | None:
    """``location`` or its first parent that is a symbolic link to nothing, said so."""
    parts = os.path.abspath(location).split(os.sep)
    for i in range(2, len(parts) + 1):
        here = os.sep.join(parts[:i])
        if os.path.islink(here) and not os.path.exists(here):
            return f"{here} is a symbolic link to {os.readlink(here)}, which does not exist"
    return None


def explain(error: OSError, location: str | os.PathLike | None = None) -> str:
    """One line for a file-system error a path causes: the path, what is wrong with
    it and what to do (e.g. ``/w/file/run: Not a directory (/w/file is a file):
    move that file away or choose another path``).

    Args:
      error: the error (its ``errno`` one of :data:`PATH_ERRNOS`).
      location: the path the user gave, if the error names a file inside it.
    """
    path = os.fspath(location or error.filename or "")
    reason = error.strerror or type(error).__name__
    detail = None
    if error.errno == errno.ENOTDIR and (file := _file_among_parents(path)):
        detail = f"{file} is a file"
        advice = "move that file away or choose another path"
    elif error.errno in (errno.ENOENT, errno.EEXIST) and (link := _dangling_link(path)):
        detail = link
        advice = "create what it points to, remove the link, or choose another path"
    else:
        advice = _PATH_ERRORS.get(error.errno, "choose another path")
    where = f"{path}: " if path else ""
    return f"{where}{reason}" + (f" ({detail})" if detail else "") + f": {advice}"


def make_directory(location: str | os.PathLike, what: str) -> epath.Path:
    """Creates directory ``location`` (and its parents) if missing and returns it.

    Raises:
      PathError: one line naming ``what`` (e.g. ``--workdir``) and the path,
        if it cannot be a directory.
    """
    directory = path(location)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if not directory.is_dir():  # an object store's "directory" that is a file
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", os.fspath(directory))
    except OSError as e:
        if e.errno not in PATH_ERRNOS:
            raise
        raise PathError(f"{what} {explain(e, directory)}") from None
    return directory


def output_file(location: str | os.PathLike, what: str) -> epath.Path:
    """Checks, before any work is done, that a file can be written at ``location``:
    not a directory, in a directory that exists or can be created and written to.

    Args:
      location: the file (a local path or a URL).
      what: how the user named it, e.g. ``--json``.

    Returns:
      The path.

    Raises:
      PathError: one line naming ``what``, the path and what to do.
    """
    file = path(location)
    if file.is_dir():
        raise PathError(
            f"{what} {file} is a directory: give the name of a file, e.g. {file}/"
            f"{_example_name(what)}"
        )
    parent = make_directory(file.parent, what)
    if problem := unwritable(parent):
        raise PathError(f"{what} {file}: {problem} in {parent}: choose another path")
    return file


def _example_name(what: str) -> str:
    return {"--json": "results.json", "--out": "runs.png", "--eval_text": "sentences.txt"}.get(
        what, "out"
    )


def write_atomically(location: str | os.PathLike, content: str | bytes) -> None:
    """Writes ``content`` (text or bytes) to ``location`` so that a reader sees the old
    content or the new, never a part: a temporary file renamed over it (one object in
    a store)."""
    file = path(location)
    data = content.encode() if isinstance(content, str) else content
    if is_remote(file):
        file.write_bytes(data)  # an object is replaced whole
        return
    partial = file.with_name(f".{file.name}.{os.getpid()}.partial")
    partial.write_bytes(data)
    os.replace(partial, file)


def path(location: str | os.PathLike) -> epath.Path:
    """``location`` as a path: URLs as they are, local paths made absolute
    (Orbax and TensorStore want absolute ones)."""
    text = os.fspath(location)
    if "://" in text:
        return epath.Path(text)
    return epath.Path(os.path.abspath(os.path.expanduser(text)))


# The host every gs:// access goes to (without a local emulator).
_GCS_HOST = "storage.googleapis.com"


@functools.cache
def _resolves(host: str) -> str | None:
    """Why ``host`` has no address here (None: it resolves), asked once a process."""
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_reachable(location: str | os.PathLike, what: str) -> None:
    """Fails at once, in one line, where ``location`` is in an object store this
    machine cannot reach (no network): gcsfs would retry for a minute and log a
    traceback for each attempt before saying so.

    Raises:
      PathError: naming ``what`` (the flag or config key), the location and why.
    """
    text = os.fspath(location)
    if not text.startswith("gs://") or os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    if (problem := _resolves(_GCS_HOST)) is not None:
        raise PathError(
            f"{what} {text}: this machine cannot reach Google Cloud Storage ({_GCS_HOST}: "
            f"{problem}): check its network, or use a local path"
        )


def workdir(location: str | os.PathLike | None) -> epath.Path:
    """The run directory ``location`` as a path, after the checks a user's typo
    fails (ConfigError): not empty (it would mean the current directory), not a file."""
    if location is None or not os.fspath(location).strip():
        raise ConfigError("--workdir is empty: give the directory for checkpoints and metrics")
    directory = path(location)
    text = os.fspath(directory)
    if text.startswith("gs://"):
        check_reachable(text, "--workdir")
        bucket = text[len("gs://") :].split("/", 1)[0]
        if not path(f"gs://{bucket}").exists():
            raise ConfigError(
                f"--workdir {text}: the bucket gs://{bucket} does not exist (or this machine "
                f"cannot see it): create it first, e.g. gcloud storage buckets create "
                f"gs://{bucket}"
            )
    if directory.exists() and not directory.is_dir():
        raise ConfigError(f"--workdir {directory} is a file, not a directory")
    if not is_remote(directory):
        make_directory(directory, "--workdir")
    return directory


def unwritable(directory: epath.Path) -> str | None:
    """Why files cannot be written in ``directory`` (created if missing), or None if
    they can: a small probe file is written and removed."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def is_remote(location: str | os.PathLike) -> bool:
    """Whether ``location`` is a URL (an object store) rather than a local path."""
    return "://" in os.fspath(location)


def configure() -> None:
    """Wires ``STORAGE_EMULATOR_HOST`` into every storage library; a no-op without it.

    Call before the first ``gs://`` access. Values the user set are kept.
    """
    emulator = os.environ.get("STORAGE_EMULATOR_HOST")
    if not emulator:
        return
    url = emulator if "://" in emulator else f"http://{emulator}"
    # TensorStore (Orbax's array data): the endpoint, and a fixed bearer token
    # so it neither searches for credentials (the metadata server) nor sends
    # real ones to the emulator.
    os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    # google-cloud-cpp, which array_record uses to read gs:// datasets.
    os.environ.setdefault("CLOUD_STORAGE_EMULATOR_ENDPOINT", url)
    # gcsfs's default file system first asks the storage-control gRPC API
    # whether a bucket is hierarchical or zonal; against the emulator that call
    # waits 60 s per bucket before falling back to the JSON API. The plain
    # JSON-API file system skips it (read at gcsfs import: also register it).
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    import fsspec  # noqa: PLC0415  (reads the variable above at import)
    from gcsfs.core import GCSFileSystem  # noqa: PLC0415

    for protocol in GCSFileSystem.protocol:
        fsspec.register_implementation(protocol, GCSFileSystem, clobber=True)
        # The emulator needs no credentials; don't look for any.
        fsspec.config.conf.setdefault(protocol, {}).setdefault("token", "anon")


class AppendOnlyFile:
    """A file that only grows, on a local disk or in an object store.

    Object stores cannot append: there the whole content is kept in memory
    (read back first, so a resumed run continues the file) and the object is
    rewritten by :meth:`flush`, at most every ``min_interval_s`` seconds, and
    by :meth:`close`. An object is replaced whole, so a reader never sees a
    half-written line. Thread-safe (TensorBoard flushes from its own thread).

    Args:
      location: the file.
      binary: write bytes rather than text.
      min_interval_s: on object stores, flushes closer together than this
        are deferred to a later flush or the close.
    """

    def __init__(
        self, location: str | os.PathLike, *, binary: bool = False, min_interval_s: float = 0.0
    ):
        self._path = path(location)
        self._binary = binary
        self._lock = threading.Lock()
        self._min_interval_s = min_interval_s
        self._path.parent.mkdir(parents=True, exist_ok=True)
        if is_remote(self._path):
            self._file = None
            self._content = bytearray(self._path.read_bytes() if self._path.exists() else b"")
            self._uploaded_at = -math.inf
            self._dirty = False
        else:
            self._file = self._path.open("ab" if binary else "a")

    def write(self, data: str | bytes) -> None:
        """Appends ``data`` (bytes if ``binary``, else text)."""
        with self._lock:
            if self._file is not None:
                self._file.write(data)
            else:
                self._content += data if self._binary else data.encode()
                self._dirty = True

    def flush(self) -> None:
        """Makes the content written so far visible (see the class docstring)."""
        with self._lock:
            if self._file is not None:
                self._file.flush()
            elif time.monotonic() - self._uploaded_at >= self._min_interval_s:
                self._upload()

    def close(self) -> None:
        """Flushes everything and closes the file."""
        with self._lock:
            if self._file is not None:
                self._file.close()
            else:
                self._upload()

    def _upload(self) -> None:
        if self._dirty:
            self._path.write_bytes(bytes(self._content))
            self._dirty = False
        self._uploaded_at = time.monotonic()
