"""A run's JSON-lines files (``metrics.jsonl``, ``eval.jsonl``), read tolerantly.

These files outlive the processes that write them: a kill cuts the last line, a
disk error or a hand edit leaves bytes that are not UTF-8 or not JSON, another tool
writes ``"step": "4"``. Every reader of them (a resume, the summary, ``trainer.plot``)
goes through :func:`read`, which keeps the rows it can use and counts the others,
so one damaged line never stops a command or a run. Nothing is deleted that no run
can write again: a resume keeps the lines it cannot read in ``UNREADABLE``
(:func:`drop_rows_after`), and a run that starts over sets the whole file aside
(:func:`set_aside`).
"""

from __future__ import annotations

import json
import os
import time

from etils import epath

from trainer.workdir import storage

METRICS = "metrics.jsonl"
# Lines of metrics.jsonl that a resume could not read, kept as they were.
UNREADABLE = "metrics.unreadable.jsonl"


def usable(row: object) -> bool:
    """Whether ``row`` is a row the tools can use: an object with an integer ``step``."""
    if not isinstance(row, dict):
        return False
    step = row.get("step")
    return isinstance(step, int) and not isinstance(step, bool) and step >= 0


def read(location: str | os.PathLike) -> tuple[list[dict], int]:
    """The usable rows of a JSON-lines file, in file order, and how many lines were not.

    A line is skipped if it is not UTF-8, not a JSON object, or has no integer
    ``step`` (:func:`usable`); blank lines count as skipped too (the trainer writes
    none). A missing file has no rows.
    """
    rows, unreadable = _read_lines(storage.path(location))
    return rows, len(unreadable)


def _read_lines(file: epath.Path) -> tuple[list[dict], list[bytes]]:
    """The usable rows of ``file`` and its other lines, as they are."""
    if not file.exists():
        return [], []
    rows, unreadable = [], []
    for line in file.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            row = None
        if usable(row):
            rows.append(row)
        else:
            unreadable.append(line)
    return rows, unreadable


def drop_rows_after(workdir: str | os.PathLike, step: int) -> tuple[int, epath.Path | None]:
    """Removes the rows of steps after ``step`` from ``workdir/metrics.jsonl`` (a
    resumed run logs those steps again, bit for bit the same training, so each step
    has one row), and moves the lines no tool can read to ``workdir/UNREADABLE``
    (appended, as they were). Returns how many lines were moved, and where.

    The file is replaced whole (atomically on a local disk, as one object in a
    store), and only if something changes.
    """
    directory = storage.path(workdir)
    path = directory / METRICS
    kept, unreadable = _read_lines(path)
    before = len(kept)
    kept = [row for row in kept if row["step"] <= step]
    kept_aside = None
    if unreadable:
        kept_aside = directory / UNREADABLE
        old = kept_aside.read_bytes() if kept_aside.exists() else b""
        storage.write_atomically(kept_aside, old + b"".join(line + b"\n" for line in unreadable))
    if unreadable or len(kept) != before:
        storage.write_atomically(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(unreadable), kept_aside


def set_aside(workdir: str | os.PathLike, destination: epath.Path) -> epath.Path | None:
    """Moves ``workdir/metrics.jsonl`` into ``destination`` as ``metrics-<time>.jsonl``
    (a run that starts over keeps the rows of the steps it lost); returns the new
    path, or None if there was no file."""
    path = storage.path(workdir) / METRICS
    if not path.exists():
        return None
    destination.mkdir(parents=True, exist_ok=True)
    kept = destination / f"metrics-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    path.rename(kept)
    return kept


def skipped_warning(
    location: str | os.PathLike, skipped: int, kept: str | os.PathLike | None = None
) -> str:
    """The one warning about ``skipped`` unusable lines of ``location`` (and where they
    were ``kept``, if they were moved)."""
    lines = "line" if skipped == 1 else "lines"
    where = f"; they are kept in {kept}" if kept else ""
    return (
        f"skipped {skipped} unreadable {lines} of {location} (cut short, not UTF-8, not a "
        f"JSON object, or without an integer step); the other rows are used{where}"
    )
