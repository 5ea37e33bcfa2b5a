"""Your own files, as every text pipeline reads them: globs (local or URLs), formats
by suffix, gzip, and damaged rows skipped and counted by reason in one warning.

:mod:`trainer.input.text_pairs` (sentence pairs) and :mod:`trainer.input.text_files`
(documents) read through here.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import gzip
import os
import re
from collections.abc import Iterator, Sequence

from etils import epath

from trainer import console
from trainer.errors import ConfigError
from trainer.workdir import storage

_GLOB = re.compile(r"[*?\[]")


@dataclasses.dataclass
class Skipped:
    """Rows skipped while reading, by reason: how many, and where the first one was.

    Attributes:
      reasons: the reasons in the order a warning lists them.
    """

    reasons: tuple[str, ...]
    counts: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    first: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, reason: str, where: str) -> None:
        self.counts[reason] += 1
        self.first.setdefault(reason, where)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def describe(self) -> str:
        """E.g. ``2 no tab (first at a.tsv:17), 1 not UTF-8 (first at a.tsv:40)``."""
        return ", ".join(
            f"{self.counts[r]} {r} (first at {self.first[r]})"
            for r in self.reasons
            if self.counts[r]
        )

    def warn(self, key: str, kept: int, what: str, names: str) -> None:
        """One warning counting the skipped rows by reason (none if nothing was)."""
        if self.total:
            console.warn(
                f"{key}: skipped {self.total:,} of {self.total + kept:,} {what} of {names}: "
                f"{self.describe()}"
            )


def expand(patterns: Sequence[str] | str, key: str) -> list[epath.Path]:
    """The files ``patterns`` name (globs, local or URLs), sorted, without repeats.
    One string holds comma-separated patterns (``--config.data.train_files=a.tsv,b.tsv``).

    Raises:
      ConfigError: naming ``key``, if there is no pattern, one matches nothing, one
        is a symbolic link to nothing (or in a loop), or one has ``**``.
      PathError: an object store this machine cannot reach.
    """
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    if not patterns:
        raise ConfigError(f"{key} is empty: give the files to read (globs allowed)")
    found: dict[str, epath.Path] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(f"{key}: {pattern!r} is not a path or a glob")
        if "**" in pattern:
            # etils refuses it (a walk of every directory below, thousands of requests
            # in a bucket): said here, in the config's terms.
            raise ConfigError(
                f"{key}: {pattern} has '**' (any depth), which is not supported: name "
                "each level with * (e.g. dir/*/*.txt), or list the patterns, comma-separated"
            )
        storage.check_reachable(pattern, key)
        _check_link(pattern, key)
        matches = _glob(str(pattern))
        if not matches:
            raise ConfigError(f"{key}: no file matches {pattern}")
        for path in matches:
            if path.is_dir():
                raise ConfigError(f"{key}: {path} is a directory; name its files (e.g. {path}/*)")
            found.setdefault(str(path), path)
    return [found[name] for name in sorted(found)]


def _check_link(pattern: str, key: str) -> None:
    """Raises ConfigError if the local path ``pattern`` (not a glob) is a symbolic link
    that leads nowhere: to nothing, or back to itself (which ``exists()`` only calls
    missing)."""
    if _GLOB.search(pattern) or "://" in pattern or not os.path.islink(pattern):
        return
    try:
        os.stat(pattern)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ConfigError(
                f"{key}: {pattern} is a symbolic link in a loop (it leads back to itself): "
                "point it at a file"
            ) from None
        if e.errno == errno.ENOENT:
            raise ConfigError(
                f"{key}: {pattern} is a symbolic link to {os.readlink(pattern)}, which does "
                "not exist"
            ) from None
        raise


def _glob(pattern: str) -> list[epath.Path]:
    if not _GLOB.search(pattern):
        path = storage.path(pattern)
        return [path] if path.exists() else []
    # The glob's fixed directory, then the rest of the pattern below it.
    parts = pattern.split("/")
    fixed = next(i for i, part in enumerate(parts) if _GLOB.search(part))
    base = storage.path("/".join(parts[:fixed]) or ".")
    if not base.is_dir():
        return []
    return sorted(base.glob("/".join(parts[fixed:])))


def file_format(path: epath.Path, formats: dict[str, str], key: str) -> tuple[str, bool]:
    """``(format, gzipped)`` of ``path`` by its suffix (``.jsonl.gz``: jsonl, gzipped).

    Raises:
      ConfigError: a suffix not among ``formats``.
    """
    name = path.name.lower()
    compressed = name.endswith(".gz")
    suffix = epath.Path(name.removesuffix(".gz")).suffix
    if suffix not in formats:
        *others, last = list(formats)
        known = f"{', '.join(others)} or {last}" if others else last
        raise ConfigError(f"{key}: {path} is not {known} (optionally .gz): its format is unknown")
    return formats[suffix], compressed


def decompressed(data: bytes, compressed: bool, path: epath.Path, key: str) -> bytes:
    """The bytes ``data`` of ``path``, decompressed if ``compressed``.

    Raises:
      ConfigError: a ``.gz`` file that is not whole.
    """
    if not compressed:
        return data
    try:
        return gzip.decompress(data)
    except (OSError, EOFError) as e:
        raise ConfigError(f"{key}: {path} is not a whole gzip file ({e})") from None


def lines(data: bytes) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of ``data``, lines ending at ``\\n`` (``\\r\\n`` too)."""
    body = data[:-1] if data.endswith(b"\n") else data
    for number, raw in enumerate(body.split(b"\n") if data else [], start=1):
        yield number, raw.removesuffix(b"\r")


def stream_lines(
    path: epath.Path, compressed: bool, key: str, digest=None
) -> Iterator[tuple[int, bytes]]:
    """As :func:`lines`, read a block at a time (for files larger than memory); each
    line fed to ``digest`` (a hashlib object), if given.

    Raises:
      ConfigError: a ``.gz`` file that is not whole.
    """
    try:
        with path.open("rb") as raw:
            stream = gzip.GzipFile(fileobj=raw) if compressed else raw
            for number, line in enumerate(stream, start=1):
                if digest is not None:
                    digest.update(line)
                yield number, line.rstrip(b"\n").removesuffix(b"\r")
    except (gzip.BadGzipFile, EOFError) as e:
        raise ConfigError(f"{key}: {path} is not a whole gzip file ({e})") from None


def describe_files(files: Sequence[epath.Path | str]) -> str:
    """The first three files and how many more: for messages."""
    names = ", ".join(str(f) for f in files[:3])
    return names + (f" (+{len(files) - 3})" if len(files) > 3 else "")
