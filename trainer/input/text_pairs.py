"""Sentence pairs from your own files: ``data.name = "text_pairs"``.

``data.train_files`` and ``data.eval_files`` are globs (local paths or URLs such as
``gs://bucket/pairs/*.tsv``), each file one pair a line:

* ``.tsv`` (or ``.txt``): ``source<TAB>target``, the source in ``data.source_lang``;
* ``.jsonl``: ``{"en": "...", "de": "..."}``, the keys ``data.source_lang`` and
  ``data.target_lang`` (any names: they only label the two sides);
* either gzip-compressed (``.tsv.gz``, ``.jsonl.gz``).

A damaged row (no tab, more than one, an empty side, bytes that are not UTF-8, a
line that is not a JSON object with both keys) is skipped and counted, by reason,
with the first file and line of each: one warning, never a traceback.

Every process reads every file, in sorted order, into memory (a few hundred bytes
a pair: this is for corpora up to a few million pairs; WMT-sized data belongs in
TFDS). The pairs then take the TFDS path of :mod:`trainer.input.translation`: the
same seeded global order of packed rows, each process tokenizing only its own rows
of each global batch, a SentencePiece vocabulary trained on the training pairs and
BLEU on the eval pairs. The vocabulary is named after a digest of the training
files' bytes, so changed files train a new one.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import hashlib
import json
import re
from collections.abc import Iterable, Sequence

from etils import epath

from trainer import console
from trainer.errors import ConfigError
from trainer.workdir import storage

NAME = "text_pairs"
_GLOB = re.compile(r"[*?\[]")
_FORMATS = {".tsv": "tsv", ".txt": "tsv", ".jsonl": "jsonl"}
# Reasons a row is skipped, in the order a warning lists them.
_REASONS = (
    "not UTF-8",
    "no tab",
    "more than one tab",
    "not a JSON object",
    "missing a language key",
    "empty side",
)


@dataclasses.dataclass
class Skipped:
    """Rows skipped while reading, by reason: how many, and where the first one was."""

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
            f"{self.counts[r]} {r} (first at {self.first[r]})" for r in _REASONS if self.counts[r]
        )


class TextPairs(Sequence):
    """The pairs of a set of files, as the TFDS sources give them: record ``i`` is
    ``{source_lang: text, target_lang: text}``.

    Attributes:
      files: the files read, in order.
      skipped: the damaged rows left out.
      digest: a digest of the files' bytes and the two language names.
    """

    def __init__(
        self,
        sources: list[str],
        targets: list[str],
        languages: tuple[str, str],
        files: list[str],
        skipped: Skipped,
        digest: str,
    ):
        self._sources, self._targets, self._languages = sources, targets, languages
        self.files, self.skipped, self.digest = files, skipped, digest

    def __len__(self) -> int:
        return len(self._sources)

    def __getitem__(self, index: int) -> dict[str, str]:
        source, target = self._languages
        return {source: self._sources[index], target: self._targets[index]}

    def __getitems__(self, indices: Iterable[int]) -> list[dict[str, str]]:
        return [self[int(i)] for i in indices]


def expand(patterns: Sequence[str] | str, key: str) -> list[epath.Path]:
    """The files ``patterns`` name (globs, local or URLs), sorted, without repeats.
    One string holds comma-separated patterns (``--config.data.train_files=a.tsv,b.tsv``).

    Raises:
      ConfigError: naming ``key``, if there is no pattern or one matches nothing.
    """
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    if not patterns:
        raise ConfigError(f"{key} is empty: give the files of sentence pairs (globs allowed)")
    found: dict[str, epath.Path] = {}
    for pattern in patterns:
        storage.check_reachable(pattern, key)
        matches = _glob(str(pattern))
        if not matches:
            raise ConfigError(f"{key}: no file matches {pattern}")
        for path in matches:
            if path.is_dir():
                raise ConfigError(f"{key}: {path} is a directory; name its files (e.g. {path}/*)")
            found.setdefault(str(path), path)
    return [found[name] for name in sorted(found)]


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


def _format(path: epath.Path, key: str) -> tuple[str, bool]:
    name = path.name.lower()
    compressed = name.endswith(".gz")
    suffix = epath.Path(name.removesuffix(".gz")).suffix
    if suffix not in _FORMATS:
        raise ConfigError(
            f"{key}: {path} is not .tsv, .txt or .jsonl (optionally .gz): its format is unknown"
        )
    return _FORMATS[suffix], compressed


def read(
    patterns: Sequence[str] | str, source_lang: str, target_lang: str, *, key: str
) -> TextPairs:
    """Reads the pairs of the files ``patterns`` names (see the module docstring).

    Args:
      key: the config key the patterns came from, for messages.

    Raises:
      ConfigError: no pattern, one matches nothing, an unknown format, a file that
        cannot be decompressed, or no usable pair at all.
    """
    files = expand(patterns, key)
    digest = hashlib.sha256(f"{source_lang}\t{target_lang}".encode())
    sources: list[str] = []
    targets: list[str] = []
    skipped = Skipped()
    for path in files:
        kind, compressed = _format(path, key)
        data = path.read_bytes()
        digest.update(hashlib.sha256(data).digest())
        if compressed:
            try:
                data = gzip.decompress(data)
            except (OSError, EOFError) as e:
                raise ConfigError(f"{key}: {path} is not a whole gzip file ({e})") from None
        body = data[:-1] if data.endswith(b"\n") else data
        for number, raw in enumerate(body.split(b"\n") if data else [], start=1):
            pair = _parse(raw.removesuffix(b"\r"), kind, source_lang, target_lang)
            if isinstance(pair, str):
                skipped.add(pair, f"{path.name}:{number}")
            else:
                sources.append(pair[0])
                targets.append(pair[1])
    names = ", ".join(str(f) for f in files[:3]) + (
        f" (+{len(files) - 3})" if len(files) > 3 else ""
    )
    if not sources:
        detail = f": {skipped.describe()}" if skipped.total else ""
        raise ConfigError(f"{key}: no usable sentence pair in {names}{detail}")
    if skipped.total:
        console.warn(
            f"{key}: skipped {skipped.total:,} of {skipped.total + len(sources):,} rows of "
            f"{names}: {skipped.describe()}"
        )
    return TextPairs(
        sources,
        targets,
        (source_lang, target_lang),
        [str(f) for f in files],
        skipped,
        digest.hexdigest()[:16],
    )


def _parse(raw: bytes, kind: str, source_lang: str, target_lang: str) -> tuple[str, str] | str:
    """A line -> (source, target), or the reason it is skipped."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    if kind == "tsv":
        fields = text.split("\t")
        if len(fields) < 2:
            return "no tab"
        if len(fields) > 2:
            return "more than one tab"
        source, target = fields
    else:
        try:
            row = json.loads(text)
        except ValueError:
            return "not a JSON object"
        if not isinstance(row, dict):
            return "not a JSON object"
        source, target = row.get(source_lang), row.get(target_lang)
        if not isinstance(source, str) or not isinstance(target, str):
            return "missing a language key"
    source, target = source.strip(), target.strip()
    if not source or not target:
        return "empty side"
    return source, target
