"""A corpus tokenized once, for corpora larger than memory: ``python -m trainer.data.prepare``
writes it, a run memory-maps it (``data.tokenized_dir``).

A store is a directory:

* ``tokens.bin``: every document's tokens (BOS and EOS included), one after another,
  as little-endian ``uint16`` where the vocabulary fits (``uint32`` else);
* ``offsets.npy``: int64 [documents + 1], where each document starts in ``tokens.bin``;
* the tokenizer's files (:attr:`trainer.input.tokenizer.TextTokenizer.files`), so that
  the store alone says how to read it;
* ``store.json``: what it holds (documents, tokens, dtype, the largest id, the files
  it came from and the documents skipped, by reason).

Opening a store checks that its parts agree before a row is built: ``store.json`` an
object with its counts, ``offsets.npy`` int64 [documents + 1] rising from 0 to the
token count, ``tokens.bin`` exactly that many tokens of the dtype, and its largest id
inside the tokenizer's vocabulary; each document's ids are checked again when it is
read (a store edited since, or written by another tool). A part that is missing or
disagrees is named as a part of the store, with what to do: write it again.

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
    largest = -1
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
                if row.size:
                    largest = max(largest, int(row.max()))
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
        "max_id": largest,
        "tokenizer": tokenizer.kind,
        "sources": list(sources),
        "skipped": dict(skipped or {}),
        "seconds": round(time.perf_counter() - start, 1),
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


_DTYPES = ("uint16", "uint32")
_HOW = "write it again with python -m trainer.data.prepare --out DIR"


class TokenStore:
    """A store, memory-mapped: the documents of a run (picklable: worker processes map
    it again).

    Attributes:
      lengths: int64 [documents]: each document's tokens.
      tokenizer: the tokenizer the store was written with.

    Raises (when built):
      ConfigError: naming the store, for a part missing or damaged (the module docstring).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = epath.Path(directory)
        where = f"data.tokenized_dir={self.directory}"
        if not self.directory.is_dir():
            raise ConfigError(
                f"{where} is not a directory: name a token store (python -m "
                "trainer.data.prepare --out DIR writes one)"
            )
        if not (self.directory / MANIFEST).exists():
            raise ConfigError(f"{where} is not a token store (no {MANIFEST}): {_HOW}")
        for part in (TOKENS, OFFSETS):
            if not (self.directory / part).exists():
                raise ConfigError(
                    f"{where}: the token store has no {part}, one of its parts: {_HOW}"
                )
        self.manifest = _manifest(self.directory / MANIFEST, where)
        files = {
            name: (self.directory / name).read_bytes()
            for name in (*tokenizer_lib.HF_FILES, tokenizer_lib.SPM_FILE)
            if (self.directory / name).exists()
        }
        self.tokenizer = tokenizer_lib.tokenizer_from_files(files, str(self.directory))
        offsets = _offsets(self.directory / OFFSETS, self.manifest, where)
        itemsize = np.dtype(self.manifest["dtype"]).itemsize
        size = (self.directory / TOKENS).stat().length
        if size != self.manifest["tokens"] * itemsize:
            raise ConfigError(
                f"{where}: {TOKENS} has {size:,} bytes, but {MANIFEST} says "
                f"{self.manifest['tokens']:,} {self.manifest['dtype']} tokens "
                f"({self.manifest['tokens'] * itemsize:,} bytes): it is cut short or was "
                f"written otherwise; {_HOW}"
            )
        self._vocab_size = self.tokenizer.vocab_size
        largest = self.manifest.get("max_id")
        if isinstance(largest, int) and largest >= self._vocab_size:
            raise ConfigError(
                f"{where}: its ids reach {largest}, past the {self._vocab_size:,} ids of its "
                f"tokenizer: it was written with another tokenizer; {_HOW}"
            )
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
        """Each document's tokens, BOS and EOS included (copied out of the map).

        Raises:
          ConfigError: a document with an id past the tokenizer's vocabulary (its
            embedding row does not exist: the loss would be garbage, not an error).
        """
        tokens = self._map()
        out = []
        for i in (int(i) for i in indices):
            document = np.asarray(tokens[self._offsets[i] : self._offsets[i + 1]], np.int32)
            if document.size and (document.max() >= self._vocab_size or document.min() < 0):
                raise ConfigError(
                    f"data.tokenized_dir={self.directory}: document {i} of the token store "
                    f"has id {int(document.max())}, past the {self._vocab_size:,} ids of its "
                    f"tokenizer: {TOKENS} was edited or written with another tokenizer; {_HOW}"
                )
            out.append(document)
        return out


def _manifest(path: epath.Path, where: str) -> dict:
    """``store.json``, checked: an object with int counts and a known dtype."""
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(
            f"{where}: {MANIFEST} is not JSON ({' '.join(str(e).split())}); {_HOW}"
        ) from None
    if not isinstance(manifest, dict):
        raise ConfigError(f"{where}: {MANIFEST} is not a JSON object; {_HOW}")
    for key in ("documents", "tokens"):
        value = manifest.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(
                f"{where}: {MANIFEST}'s {key}={json.dumps(value)} is not a count; {_HOW}"
            )
    if manifest.get("dtype") not in _DTYPES:
        raise ConfigError(
            f"{where}: {MANIFEST}'s dtype={json.dumps(manifest.get('dtype'))} is not one a "
            f"store is written in ({', '.join(_DTYPES)}); {_HOW}"
        )
    return manifest


def _offsets(path: epath.Path, manifest: dict, where: str) -> np.ndarray:
    """``offsets.npy``, checked against ``store.json``: int64 [documents + 1], rising
    from 0 to the token count."""
    try:
        with path.open("rb") as f:
            offsets = np.load(f, allow_pickle=False)
    except (ValueError, EOFError, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise ConfigError(
            f"{where}: {OFFSETS} is not a NumPy array file ({' '.join(str(e).split())}); {_HOW}"
        ) from None
    documents, tokens = manifest["documents"], manifest["tokens"]
    if (
        offsets.shape != (documents + 1,)
        or not np.issubdtype(offsets.dtype, np.integer)
        or offsets[0] != 0
        or offsets[-1] != tokens
        or np.any(np.diff(offsets) < 0)
    ):
        raise ConfigError(
            f"{where}: {OFFSETS} ({offsets.dtype} {offsets.shape}) is not the start of each "
            f"of the {documents:,} documents from 0 to the {tokens:,} tokens {MANIFEST} "
            f"counts; {_HOW}"
        )
    return offsets.astype(np.int64)
