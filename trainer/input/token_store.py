"""A corpus tokenized once, for corpora larger than memory: ``python -m trainer.data.prepare``
writes it, a run memory-maps it (``data.tokenized_dir``).

A store is a directory:

* ``tokens.bin``: every document's tokens (BOS and EOS included), one after another,
  as little-endian ``uint16`` where the vocabulary fits (``uint32`` else);
* ``offsets.npy``: int64 [documents + 1], where each document starts in ``tokens.bin``;
* the tokenizer's files (:attr:`trainer.input.tokenizer.TextTokenizer.files`), so that
  the store alone says how to read it;
* ``store.json``: what it holds (documents, tokens, dtype, the files it came from and
  the documents skipped, by reason).

Writing streams: documents are read a batch at a time, tokenized and appended, so the
writer holds a batch and the growing offsets (8 bytes a document), never the corpus.
Reading maps the file: a row's tokens are paged in when it is built.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from etils import epath

from trainer import console
from trainer.errors import ConfigError
from trainer.input import tokenizer as tokenizer_lib

TOKENS = "tokens.bin"
OFFSETS = "offsets.npy"
MANIFEST = "store.json"
_BATCH = 2048  # documents tokenized together


def _batches(documents: Iterable[str], size: int) -> Iterator[list[str]]:
    batch: list[str] = []
    for document in documents:
        batch.append(document)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def write(
    directory: str | os.PathLike,
    documents: Iterable[str],
    tokenizer: tokenizer_lib.TextTokenizer,
    *,
    sources: Sequence[str] = (),
    skipped: dict[str, int] | None = None,
) -> dict:
    """Tokenizes ``documents`` (streaming) into a new store at ``directory`` (local).

    Returns:
      The manifest written as ``store.json``.

    Raises:
      ConfigError: ``directory`` exists and is not empty.
    """
    out = epath.Path(directory)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} already exists and is not empty: choose a new --out or remove it")
    out.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32
    offsets = [0]
    start = time.perf_counter()
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    with (
        open(out / TOKENS, "wb") as f,
        console.progress(desc="tokenizing", unit="documents") as bar,
    ):
        for batch in _batches(documents, _BATCH):
            for ids in tokenizer.encode_batch(batch):
                row = np.asarray([*bos, *ids, *eos], dtype).astype("<" + np.dtype(dtype).str[1:])
                f.write(row.tobytes())
                offsets.append(offsets[-1] + len(row))
            bar.update(len(batch))
    np.save(out / OFFSETS, np.asarray(offsets, np.int64))
    for name, content in tokenizer.files.items():
        (out / name).write_bytes(content)
    manifest = {
        "documents": len(offsets) - 1,
        "tokens": offsets[-1],
        "dtype": np.dtype(dtype).name,
        "tokenizer": tokenizer.kind,
        "sources": list(sources),
        "skipped": dict(skipped or {}),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


class TokenStore:
    """A store, memory-mapped: the documents of a run (picklable: worker processes map
    it again).

    Attributes:
      lengths: int64 [documents]: each document's tokens.
      tokenizer: the tokenizer the store was written with.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = epath.Path(directory)
        manifest = self.directory / MANIFEST
        if not manifest.exists():
            raise ConfigError(
                f"data.tokenized_dir={self.directory} is not a token store (no {MANIFEST}): "
                "write one with python -m trainer.data.prepare"
            )
        self.manifest = json.loads(manifest.read_text())
        files = {
            name: (self.directory / name).read_bytes()
            for name in (*tokenizer_lib.HF_FILES, tokenizer_lib.SPM_FILE)
            if (self.directory / name).exists()
        }
        self.tokenizer = tokenizer_lib.tokenizer_from_files(files, str(self.directory))
        offsets = np.load(self.directory / OFFSETS)
        self.lengths = np.diff(offsets)
        self._offsets = offsets
        self._tokens = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}

    def _map(self) -> np.ndarray:
        if self._tokens is None:
            dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
            self._tokens = np.memmap(self.directory / TOKENS, dtype=dtype, mode="r")
        return self._tokens

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Each document's tokens, BOS and EOS included (copied out of the map)."""
        tokens = self._map()
        return [
            np.asarray(tokens[self._offsets[i] : self._offsets[i + 1]], np.int32)
            for i in (int(i) for i in indices)
        ]
