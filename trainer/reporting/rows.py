"""A run's JSON-lines files (``metrics.jsonl``, ``eval.jsonl``), read tolerantly.

These files outlive the processes that write them: a kill cuts the last line, a
disk error or a hand edit leaves bytes that are not UTF-8 or not JSON, another tool
writes ``"step": "4"``. Every reader of them (a resume, the summary, ``trainer.plot``)
goes through :func:`read`, which keeps the rows it can use and counts the others,
so one damaged line never stops a command or a run.
"""

from __future__ import annotations

import json
import os

from trainer.workdir import storage


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
    file = storage.path(location)
    if not file.exists():
        return [], 0
    rows, skipped = [], 0
    for line in file.read_bytes().splitlines():
        try:
            row = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            row = None
        if usable(row):
            rows.append(row)
        else:
            skipped += 1
    return rows, skipped


def skipped_warning(location: str | os.PathLike, skipped: int) -> str:
    """The one warning about ``skipped`` unusable lines of ``location``."""
    lines = "line" if skipped == 1 else "lines"
    return (
        f"skipped {skipped} unreadable {lines} of {location} (cut short, not UTF-8, not a "
        "JSON object, or without an integer step); the other rows are used"
    )
