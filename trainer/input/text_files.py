"""Documents from your own files: ``data.name = "text_files"``.

``data.train_files`` and ``data.eval_files`` are globs (local paths or URLs such as
``gs://bucket/corpus/*.jsonl.gz``, comma-separated for several) of:

* ``.txt``: plain text. ``data.document`` says where a document ends: ``"line"``,
  every line is a document; ``"blank_line"``, documents are runs of lines separated
  by one or more blank lines (their lines joined with ``\\n``);
* ``.jsonl``: one JSON object a line, the document under ``data.text_field``
  (``"text"`` by default, the Hugging Face datasets convention);
* ``.parquet``: the column ``data.text_field`` of a Parquet file (how Hugging Face
  datasets are usually shipped);
* ``.txt`` and ``.jsonl`` optionally gzip-compressed (``.txt.gz``, ``.jsonl.gz``).

A damaged document (bytes that are not UTF-8, a JSON line that is not an object,
has no such field or holds something else than a string there, an empty document)
is skipped and counted by reason, with the first file and line of each: one
warning, never a traceback. A Parquet column that is not text at all (integers) is
refused in one line naming it. Files are read in
sorted order; the documents keep that order (the training order is a seeded
shuffle of them, :mod:`trainer.input.language`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence

from etils import epath

from trainer.errors import ConfigError
from trainer.input import corpus

NAME = "text_files"
_FORMATS = {".txt": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
DOCUMENT_SPLITS = ("line", "blank_line")
# Reasons a document is skipped, in the order a warning lists them.
REASONS = (
    "not UTF-8",
    "not a JSON object",
    "missing the text field",
    "text field not a string",
    "empty document",
)


@dataclasses.dataclass(frozen=True)
class Reading:
    """How to read documents out of files.

    Attributes:
      document: ``"line"`` or ``"blank_line"`` (.txt only; see the module docstring).
      text_field: the JSON key or Parquet column that holds a document's text.
      key: the config key the files came from, for messages.
    """

    document: str = "line"
    text_field: str = "text"
    key: str = "data.train_files"

    def __post_init__(self):
        if self.document not in DOCUMENT_SPLITS:
            raise ConfigError(
                f"data.document={self.document!r}: a .txt document ends at a 'line' or at a "
                f"'blank_line'"
            )


@dataclasses.dataclass(frozen=True)
class Documents(Sequence):
    """The documents of a set of files, in memory: ``documents[i]`` is a string.

    Attributes:
      files: the files read, in order.
      digest: of the files' bytes and the reading options (names caches of it).
    """

    texts: list[str]
    files: tuple[str, ...]
    digest: str

    def __len__(self) -> int:
        return len(self.texts)

    def __getitem__(self, index):
        return self.texts[index]


def iter_documents(
    files: Sequence[epath.Path], reading: Reading, skipped: corpus.Skipped, digest=None
) -> Iterator[str]:
    """The documents of ``files`` in order, streaming (no file whole in memory);
    damaged ones counted in ``skipped``; what was read fed to ``digest`` (a hashlib
    object), if given."""
    for path in files:
        kind, compressed = corpus.file_format(path, _FORMATS, reading.key)
        if kind == "parquet":
            yield from _parquet(path, reading, skipped, digest)
            continue
        lines = corpus.stream_lines(path, compressed, reading.key, digest)
        if kind == "txt" and reading.document == "blank_line":
            yield from _paragraphs(lines, path.name, skipped)
            continue
        parse = _jsonl if kind == "jsonl" else _txt_line
        for number, raw in lines:
            text = parse(raw, reading.text_field)
            if text is None:
                continue  # a blank line between documents: no document, no damage
            if text in REASONS:
                skipped.add(text, f"{path.name}:{number}")
            else:
                yield text


def read(patterns: Sequence[str] | str, reading: Reading) -> Documents:
    """All the documents of the files ``patterns`` name, in memory.

    Raises:
      ConfigError: no pattern, one matches nothing, an unknown format, a damaged gzip
        file, a Parquet file without the column, or no usable document at all.
    """
    files = corpus.expand(patterns, reading.key)
    digest = hashlib.sha256(f"{reading.document}\t{reading.text_field}".encode())
    skipped = corpus.Skipped(REASONS)
    texts = list(iter_documents(files, reading, skipped, digest))
    names = corpus.describe_files(files)
    if not texts:
        detail = f": {skipped.describe()}" if skipped.total else ""
        raise ConfigError(f"{reading.key}: no usable document in {names}{detail}")
    skipped.warn(reading.key, len(texts), "documents", names)
    return Documents(texts, tuple(str(f) for f in files), digest.hexdigest()[:16])


def _txt_line(raw: bytes, field: str) -> str | None:
    del field
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return "not UTF-8"
    return text if text.strip() else None


def _jsonl(raw: bytes, field: str) -> str:
    try:
        row = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        return "not UTF-8"
    except ValueError:
        return "not a JSON object"
    if not isinstance(row, dict):
        return "not a JSON object"
    if row.get(field) is None:
        return "missing the text field"
    text = row[field]
    if not isinstance(text, str):
        return "text field not a string"
    return text if text.strip() else "empty document"


def _paragraphs(
    lines: Iterator[tuple[int, bytes]], name: str, skipped: corpus.Skipped
) -> Iterator[str]:
    """Documents separated by blank lines; one with a line that is not UTF-8 is skipped."""
    current: list[str] = []
    bad, first = False, 0
    for number, raw in [*lines, (0, b"")]:  # a blank line ends the last document
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text, bad = "?", True
        if text.strip():
            first = first or number
            current.append(text)
            continue
        if current:
            if bad:
                skipped.add("not UTF-8", f"{name}:{first}")
            else:
                yield "\n".join(current)
        current, bad, first = [], False, 0


def _parquet(path: epath.Path, reading: Reading, skipped: corpus.Skipped, digest) -> Iterator[str]:
    import pyarrow as pa  # noqa: PLC0415  (only for Parquet files)
    import pyarrow.parquet as pq  # noqa: PLC0415

    with path.open("rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001  (pyarrow's errors: not a Parquet file)
            raise ConfigError(f"{reading.key}: {path} is not a Parquet file ({e})") from None
        names = parquet.schema_arrow.names
        if reading.text_field not in names:
            raise ConfigError(
                f"{reading.key}: {path} has no column {reading.text_field!r} (it has {names}); "
                "set data.text_field"
            )
        column = parquet.schema_arrow.field(reading.text_field).type
        text_types = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
        if not any(is_text(column) for is_text in text_types):
            raise ConfigError(
                f"{reading.key}: {path}'s column {reading.text_field!r} holds {column}, not "
                "text; set data.text_field to the column of the documents' text"
            )
        row = 0
        for batch in parquet.iter_batches(columns=[reading.text_field]):
            for text in batch.column(0).to_pylist():
                row += 1
                if text is None or not text.strip():
                    skipped.add("empty document", f"{path.name}:row {row}")
                    continue
                if digest is not None:
                    digest.update(text.encode() + b"\0")
                yield text
