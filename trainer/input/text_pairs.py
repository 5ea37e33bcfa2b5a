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

import hashlib
import json
from collections.abc import Iterable, Sequence

from trainer.errors import ConfigError
from trainer.input import corpus

NAME = "text_pairs"
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
        skipped: corpus.Skipped,
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
    files = corpus.expand(patterns, key)
    digest = hashlib.sha256(f"{source_lang}\t{target_lang}".encode())
    sources: list[str] = []
    targets: list[str] = []
    skipped = corpus.Skipped(_REASONS)
    for path in files:
        kind, compressed = corpus.file_format(path, _FORMATS, key)
        raw_bytes = path.read_bytes()
        digest.update(hashlib.sha256(raw_bytes).digest())
        data = corpus.decompressed(raw_bytes, compressed, path, key)
        for number, raw in corpus.lines(data):
            pair = _parse(raw, kind, source_lang, target_lang)
            if isinstance(pair, str):
                skipped.add(pair, f"{path.name}:{number}")
            else:
                sources.append(pair[0])
                targets.append(pair[1])
    names = corpus.describe_files(files)
    if not sources:
        detail = f": {skipped.describe()}" if skipped.total else ""
        raise ConfigError(f"{key}: no usable sentence pair in {names}{detail}")
    skipped.warn(key, len(sources), "rows", names)
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
