"""A language model's input: documents joined into one token stream, cut into rows.

Training, per process, for global row ``r`` of the one seeded order:

* every document is ``BOS, its tokens, EOS`` (either left out where the tokenizer has
  none); epoch ``e`` shuffles the documents with a generator seeded by ``(seed, e)``
  and joins them into one stream;
* row ``r`` of an epoch is the stream's tokens ``[r L, r L + L + 1)`` for rows of
  ``L = data.max_length`` tokens (one more: the last token's target), a decoder's; or
  ``[r L, r L + L)`` for a masked language model's. Rows do not cross epochs (an
  epoch's last partial row is dropped);
* a row holds pieces of one or more documents, told apart by segment ids (1, 2, ...
  in the row; 0 = padding), with positions restarting at 0 in each piece: attention
  never crosses a document (``models/decoder.py``), and a target is counted only
  where it continues its own document (EOS -> the next BOS is not learnt);
* each process computes only the rows of its block of each global batch
  (:mod:`trainer.input.order`), and tokenizes only their documents.

The rows need each document's token count: computed once per corpus and tokenizer
and cached beside the tokenizer (as the translation pipeline caches its pairs'), or
read from a prepared token store (:mod:`trainer.input.token_store`, ``python -m
trainer.data.prepare``: corpora larger than memory, memory-mapped). So the batches
are a function of the seed and the global batch index alone: the same on any number
of processes and workers, and the input position (a checkpoint's) is that index.

Eval: the eval documents in file order, joined and cut the same way, the first
``data.num_eval_rows`` rows (-1: all), process ``p`` of ``n`` owning rows ``p, p+n,
...`` in padded batches.

A masked language model's rows (BERT) mask 15% of their tokens (at most
``max_predictions``): 80% become the mask token, 10% a random token, 10% stay, all
drawn from a generator seeded by the global row, so they too are the same anywhere.

Batches are dicts of int32 arrays: ``inputs``, ``targets``, ``segmentation``,
``positions`` ([rows, L]) and ``weights`` (1 where a target counts); a masked model's
``inputs``, ``segmentation``, ``positions`` and ``masked_positions``, ``masked_ids``,
``masked_weights`` ([rows, max_predictions]).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from trainer.errors import ConfigError
from trainer.input import corpus, feed, options, order, packing, text_files, token_store
from trainer.input import tokenizer as tokenizer_lib
from trainer.input.builders import tiny_text
from trainer.input.options import DataOptions
from trainer.workdir import storage

Batch = dict[str, np.ndarray]
SYNTHETIC = "synthetic"
DECODER_KEYS = ("inputs", "targets", "segmentation", "positions", "weights")
MASKED_KEYS = (
    "inputs",
    "segmentation",
    "positions",
    "masked_positions",
    "masked_ids",
    "masked_weights",
)
# Documents a trained SentencePiece model learns from: evenly spaced over the corpus.
_VOCAB_TRAIN_DOCUMENTS = 200_000
_STREAM_SEED = 0  # the training stream's key; eval rows are in file order


@dataclasses.dataclass(frozen=True)
class LanguageOptions:
    """The language-model keys of the data config.

    Attributes:
      train_files, eval_files: globs of documents (:mod:`trainer.input.text_files`).
      document: how a ``.txt`` file holds documents (``line`` | ``blank_line``).
      text_field: the JSON key / Parquet column of the text.
      tokenizer: a SentencePiece ``.model``, a ``tokenizer.json`` or a directory with
        one; "" = train a SentencePiece model of ``vocab_size`` pieces on the corpus.
      vocab_size: pieces of that trained model.
      max_length: tokens per row.
      num_eval_rows: eval rows (-1: all).
      tokenized_dir: a prepared token store of the training documents ("" = none).
      masked: rows for a masked language model.
      mask_rate: the share of a row's tokens masked.
      max_predictions: masked positions per row, at most.
    """

    train_files: Any
    eval_files: Any
    document: str
    text_field: str
    tokenizer: str
    vocab_size: int
    max_length: int
    num_eval_rows: int
    tokenized_dir: str
    masked: bool = False
    mask_rate: float = 0.15
    max_predictions: int = 20


@dataclasses.dataclass(frozen=True)
class LanguageData:
    """The input side of a language-model run, for one process.

    Attributes:
      train: endless iterator of training batches with a global position.
      eval_batches: returns a fresh finite iterable of eval batches.
      tokenizer: the run's tokenizer.
    """

    train: feed.TrainBatches
    eval_batches: Callable[[], Iterable[Batch]]
    tokenizer: tokenizer_lib.TextTokenizer


def read_options(config: Any) -> LanguageOptions:
    """The language-model keys of the data section, checked.

    Raises:
      ConfigError: a key missing, or a value that cannot work.
    """
    keys = {
        "train_files": lambda v: v,
        "eval_files": lambda v: v,
        "document": str,
        "text_field": str,
        "tokenizer": lambda v: str(v or ""),
        "vocab_size": int,
        "max_length": int,
        "num_eval_rows": int,
        "tokenized_dir": lambda v: str(v or ""),
    }
    values = options.read(config, keys)
    if "masked" in config:
        values |= options.read(config, {"masked": bool, "mask_rate": float, "max_predictions": int})
    lm = LanguageOptions(**values)
    if lm.max_length < 2:
        raise ConfigError(f"data.max_length={lm.max_length} leaves no room for a target")
    if lm.masked and not 0 < lm.mask_rate < 1:
        raise ConfigError(f"data.mask_rate={lm.mask_rate} must be between 0 and 1")
    if lm.masked and lm.max_predictions < 1:
        raise ConfigError(f"data.max_predictions={lm.max_predictions} must be >= 1")
    return lm


# ----------------------------------------------------------------- documents


class TextDocuments:
    """Documents held as text, tokenized when a row needs them (picklable)."""

    def __init__(self, documents: text_files.Documents, tokenizer, lengths: np.ndarray):
        self._texts, self._tokenizer, self.lengths = documents.texts, tokenizer, lengths

    def tokens(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Each document's tokens, BOS and EOS included."""
        encoded = self._tokenizer.encode_batch([self._texts[int(i)] for i in indices])
        return [with_specials(ids, self._tokenizer) for ids in encoded]


def check_vocabulary(tokenizer, vocab_size: int) -> None:
    """Raises ConfigError if ``tokenizer``'s ids would fall outside an embedding table
    of ``vocab_size`` rows (a table larger than the tokenizer, as Qwen2's, is fine)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size:,} ids but "
            f"model.vocab_size={vocab_size:,}: its ids would fall outside the embedding"
        )


def with_specials(ids: Sequence[int], tokenizer) -> np.ndarray:
    """``BOS, ids, EOS`` (each where the tokenizer has one), int32."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return np.asarray([*bos, *ids, *eos], np.int32)


def document_lengths(cache_dir: str, documents: text_files.Documents, tokenizer) -> np.ndarray:
    """int32 [documents]: each document's tokens with its BOS and EOS, cached in
    ``cache_dir`` under the corpus's and the tokenizer's digests."""
    tokenizer_digest = hashlib.sha256(
        b"".join(tokenizer.files[name] for name in sorted(tokenizer.files))
    ).hexdigest()[:12]
    name = f"{text_files.NAME}_{documents.digest}.{tokenizer_digest}.lengths.npy"
    path = storage.path(options.data_dir(cache_dir)) / name
    specials = (tokenizer.bos_id is not None) + (tokenizer.eos_id is not None)
    lengths = packing.token_lengths(
        path,
        len(documents),
        lambda indices: [documents[i] for i in indices],
        lambda texts: [[len(ids) + specials] for ids in tokenizer.encode_batch(list(texts))],
        width=1,
    )
    return lengths[:, 0]


# ---------------------------------------------------------------------- rows


class RowPlan:
    """Global row -> the pieces of documents it holds (thread-safe, picklable).

    Args:
      lengths: each document's tokens (BOS and EOS included).
      row_tokens: tokens a row holds (``L + 1`` for a decoder, ``L`` for masked).
      stride: tokens between rows' starts (``L``).
      seed: of the per-epoch shuffle; None: the documents in order, one epoch.
    """

    def __init__(self, lengths: np.ndarray, row_tokens: int, stride: int, seed: int | None):
        self.lengths = np.asarray(lengths, np.int64)
        self.row_tokens, self.stride, self.seed = row_tokens, stride, seed
        total = int(self.lengths.sum())
        self.rows_per_epoch = max(0, (total - row_tokens) // stride + 1)
        if self.rows_per_epoch < 1:
            raise ConfigError(
                f"the documents hold {total:,} tokens, less than one row of {row_tokens}: "
                "add text or lower data.max_length"
            )
        self.__setstate__({})

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_lock", "_epochs"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token counts) of an epoch (the lock is held)."""
        if epoch not in self._epochs:
            n = len(self.lengths)
            if self.seed is None:
                order_ = np.arange(n)
            else:
                order_ = np.random.default_rng((self.seed, _STREAM_SEED, epoch)).permutation(n)
            starts = np.concatenate([[0], np.cumsum(self.lengths[order_])])
            for old in [e for e in self._epochs if e < epoch - 1]:
                del self._epochs[old]
            self._epochs[epoch] = (order_, starts)
        return self._epochs[epoch]

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """``(document, first token, end token)`` of each piece of global row ``row``."""
        epoch, within = divmod(int(row), self.rows_per_epoch)
        if self.seed is None and epoch:
            raise IndexError(f"row {row} is past the {self.rows_per_epoch} rows of the documents")
        with self._lock:
            order_, starts = self._epoch(epoch)
        start = within * self.stride
        stop = start + self.row_tokens
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, stop, side="left"))
        return [
            (
                int(order_[j]),
                max(start - int(starts[j]), 0),
                min(stop, int(starts[j + 1])) - int(starts[j]),
            )
            for j in range(first, last)
        ]


def fill_rows(rows: list[list[tuple[int, int, int]]], tokens: dict[int, np.ndarray], width: int):
    """``(tokens, segmentation, positions)`` int32 [rows, width] of rows of pieces."""
    out = [np.zeros((len(rows), width), np.int32) for _ in range(3)]
    for r, pieces in enumerate(rows):
        at = 0
        for segment, (doc, begin, end) in enumerate(pieces, start=1):
            n = end - begin
            out[0][r, at : at + n] = tokens[doc][begin:end]
            out[1][r, at : at + n] = segment
            out[2][r, at : at + n] = np.arange(n)
            at += n
    return tuple(out)


def decoder_batch(tokens: np.ndarray, segments: np.ndarray, positions: np.ndarray) -> Batch:
    """A decoder's features from rows of ``L + 1`` tokens: each token's target is the
    next one, counted only inside its own document."""
    weights = (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] > 0)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segmentation": segments[:, :-1],
        "positions": positions[:, :-1],
        "weights": weights.astype(np.int32),
    }


@dataclasses.dataclass(frozen=True)
class Masking:
    """How a masked language model's rows are masked (picklable).

    Attributes:
      rate: the share of a row's maskable tokens masked.
      max_predictions: masked positions per row, at most.
      mask_id: the mask token; vocab_size: random replacements are drawn below it.
      special: ids never masked (BOS, EOS).
      seed: with the global row, seeds each row's choices.
    """

    rate: float
    max_predictions: int
    mask_id: int
    vocab_size: int
    special: tuple[int, ...]
    seed: int

    def __call__(self, rows: np.ndarray, tokens, segments, positions) -> Batch:
        """Masked features of global ``rows`` (their [rows, L] tokens, segments and
        positions): BERT's 80/10/10, drawn from a generator seeded by each row."""
        p = self.max_predictions
        inputs = tokens.copy()
        picked = np.zeros((len(rows), p), np.int32)
        ids = np.zeros((len(rows), p), np.int32)
        weights = np.zeros((len(rows), p), np.int32)
        for r, row in enumerate(rows.tolist()):
            rng = np.random.default_rng((self.seed, 1, row))
            maskable = np.flatnonzero((segments[r] > 0) & ~np.isin(tokens[r], self.special))
            count = min(p, max(1, int(round(self.rate * len(maskable))))) if len(maskable) else 0
            chosen = np.sort(rng.choice(maskable, size=count, replace=False))
            how = rng.random(count)
            replaced = rng.integers(0, self.vocab_size, size=count)
            picked[r, :count], ids[r, :count], weights[r, :count] = chosen, tokens[r, chosen], 1
            inputs[r, chosen] = np.where(
                how < 0.8, self.mask_id, np.where(how < 0.9, replaced, tokens[r, chosen])
            )
        return {
            "inputs": inputs,
            "segmentation": segments,
            "positions": positions,
            "masked_positions": picked,
            "masked_ids": ids,
            "masked_weights": weights,
        }


class TrainBatchFn:
    """This process's rows of a global training batch (picklable for worker processes)."""

    def __init__(self, documents, plan: RowPlan, opts: DataOptions, masking: Masking | None):
        self.documents, self.plan, self.opts, self.masking = documents, plan, opts, masking

    def __call__(self, batch_index: int) -> Batch:
        opts = self.opts
        rows = order.process_rows(
            batch_index, opts.global_batch, opts.process_index, opts.local_batch
        )
        return rows_batch(rows, self.plan, self.documents, self.masking)


def rows_batch(rows: np.ndarray, plan: RowPlan, documents, masking: Masking | None) -> Batch:
    """The features of global rows ``rows`` (all real rows)."""
    pieces = [plan.pieces(r) for r in rows.tolist()]
    needed = sorted({doc for row in pieces for doc, _, _ in row})
    tokens = dict(zip(needed, documents.tokens(needed), strict=True))
    filled = fill_rows(pieces, tokens, plan.row_tokens)
    if masking is not None:
        return masking(rows, *filled)
    return decoder_batch(*filled)


# ---------------------------------------------------------------- the pipeline


def _on_tiny_text(lm: LanguageOptions, data_dir: str) -> LanguageOptions:
    """``lm`` reading the embedded corpus (written on first use); files named beside it
    are refused, not ignored."""
    for key in ("train_files", "eval_files", "tokenized_dir"):
        if getattr(lm, key):
            raise ConfigError(
                f"data.{key}={getattr(lm, key)!r} is not read: data.name="
                f"'{tiny_text.DATASET_NAME}' is the embedded corpus (set "
                f"data.name={text_files.NAME} to read your files)"
            )
    train_files, eval_files = tiny_text.prepare(data_dir)
    return dataclasses.replace(lm, train_files=train_files, eval_files=eval_files)


def make_language_data(data_config: Any, opts: DataOptions) -> LanguageData:
    """This process's training iterator, eval batches and tokenizer.

    Raises:
      ConfigError: on an inconsistent config, no usable document, or a tokenizer
        that is not one.
    """
    lm = read_options(data_config)
    if opts.name == SYNTHETIC:
        return _synthetic(lm, opts)
    if opts.name == tiny_text.DATASET_NAME:
        lm = _on_tiny_text(lm, opts.data_dir)
    elif opts.name != text_files.NAME:
        raise ConfigError(
            f"data.name={opts.name!r}: a language model reads '{text_files.NAME}' (your "
            f"files), '{tiny_text.DATASET_NAME}' (the embedded corpus) or '{SYNTHETIC}'"
        )
    reading = text_files.Reading(lm.document, lm.text_field, "data.train_files")
    if lm.tokenized_dir:
        store = token_store.TokenStore(lm.tokenized_dir)
        tokenizer, train_docs = store.tokenizer, store
    else:
        documents = text_files.read(lm.train_files, reading)
        tokenizer = _tokenizer(lm, documents, opts.data_dir)
        train_docs = TextDocuments(
            documents, tokenizer, document_lengths(opts.data_dir, documents, tokenizer)
        )
    _check_tokenizer(tokenizer, lm)
    masking = None
    if lm.masked:
        special = tuple(i for i in (tokenizer.bos_id, tokenizer.eos_id) if i is not None)
        masking = Masking(
            lm.mask_rate,
            lm.max_predictions,
            tokenizer.mask_id,
            tokenizer.vocab_size,
            special,
            opts.seed,
        )
    row_tokens = lm.max_length if lm.masked else lm.max_length + 1
    plan = RowPlan(train_docs.lengths, row_tokens, lm.max_length, opts.seed)
    train = feed.TrainBatches(TrainBatchFn(train_docs, plan, opts, masking), opts)
    eval_reading = dataclasses.replace(reading, key="data.eval_files")
    eval_docs = text_files.read(lm.eval_files, eval_reading)
    eval_lengths = document_lengths(opts.data_dir, eval_docs, tokenizer)
    evals = _eval_batches(
        TextDocuments(eval_docs, tokenizer, eval_lengths),
        RowPlan(eval_lengths, row_tokens, lm.max_length, None),
        lm,
        opts,
        masking,
    )
    return LanguageData(train, evals, tokenizer)


def write_token_store(data_config: Any, opts: DataOptions, out: str) -> dict:
    """Tokenizes the training documents of ``data_config`` into a token store at ``out``
    (:mod:`trainer.input.token_store`), reading them a batch at a time: for corpora
    larger than memory. A SentencePiece model is trained first where none is
    configured, on documents sampled evenly (a first pass over the files, keeping
    every k-th document, k doubling as the sample fills). Returns the manifest.
    """
    lm = read_options(data_config)
    if opts.name == tiny_text.DATASET_NAME:
        lm = _on_tiny_text(lm, opts.data_dir)
    reading = text_files.Reading(lm.document, lm.text_field, "data.train_files")
    files = corpus.expand(lm.train_files, reading.key)
    if lm.tokenizer:
        tokenizer = tokenizer_lib.load_text_tokenizer(lm.tokenizer)
    else:
        digest = hashlib.sha256()
        sample = _sample(text_files.iter_documents(files, reading, _skipped(), digest))
        name = f"{text_files.NAME}_{digest.hexdigest()[:16]}_spm_{lm.vocab_size}"
        name += "_mask.model" if lm.masked else ".model"
        tokenizer = tokenizer_lib.train_text_tokenizer(
            str(storage.path(options.data_dir(opts.data_dir)) / name),
            lm.vocab_size,
            lambda: sample,
            description=f"{len(sample):,} documents sampled from data.train_files",
            mask=lm.masked,
        )
    skipped = _skipped()
    manifest = token_store.write(
        out,
        text_files.iter_documents(files, reading, skipped),
        tokenizer,
        sources=[str(f) for f in files],
        skipped=dict(skipped.counts),
    )
    skipped.warn(reading.key, manifest["documents"], "documents", corpus.describe_files(files))
    return manifest


def _skipped() -> corpus.Skipped:
    return corpus.Skipped(text_files.REASONS)


def _sample(documents: Iterable[str], size: int = _VOCAB_TRAIN_DOCUMENTS) -> list[str]:
    """Every k-th document, k the smallest power of two that keeps at most ``size``."""
    kept: list[str] = []
    every = 1
    for i, document in enumerate(documents):
        if i % every == 0:
            kept.append(document)
            if len(kept) > size:
                kept, every = kept[::2], every * 2
    return kept


def _tokenizer(lm: LanguageOptions, documents: text_files.Documents, data_dir: str):
    """The configured tokenizer, or a SentencePiece model trained on ``documents``."""
    if lm.tokenizer:
        return tokenizer_lib.load_text_tokenizer(lm.tokenizer)
    name = f"{text_files.NAME}_{documents.digest}_spm_{lm.vocab_size}"
    path = str(
        storage.path(options.data_dir(data_dir)) / f"{name}{'_mask' if lm.masked else ''}.model"
    )

    def texts() -> Iterator[str]:
        count = min(len(documents), _VOCAB_TRAIN_DOCUMENTS)
        for index in np.linspace(0, len(documents) - 1, count, dtype=np.int64):
            yield documents[int(index)]

    what = f"{min(len(documents), _VOCAB_TRAIN_DOCUMENTS):,} documents of data.train_files"
    return tokenizer_lib.train_text_tokenizer(
        path, lm.vocab_size, texts, description=what, mask=lm.masked
    )


def _check_tokenizer(tokenizer, lm: LanguageOptions) -> None:
    if tokenizer.eos_id is None:
        raise ConfigError(
            "the tokenizer has no end-of-sequence token: documents could not be told apart "
            "and generation would never stop (name one in its tokenizer_config.json)"
        )
    if lm.masked and tokenizer.mask_id is None:
        raise ConfigError(
            "a masked language model needs a mask token, and this tokenizer has none "
            "(leave data.tokenizer empty to train one with <mask>)"
        )


def _eval_batches(documents, plan: RowPlan, lm: LanguageOptions, opts: DataOptions, masking):
    total = plan.rows_per_epoch
    if lm.num_eval_rows >= 0:
        total = min(total, lm.num_eval_rows)
    share = feed.EvalShare.of(total, opts)

    def batches() -> Iterator[Batch]:
        for indices in share.batch_indices():
            batch = rows_batch(indices, plan, documents, masking)
            yield feed.pad_rows(batch, share.batch)

    return lambda: feed.Counted(batches(), share.num_batches)


def _synthetic(lm: LanguageOptions, opts: DataOptions) -> LanguageData:
    """Random full rows, for throughput and compiles: no files, deterministic."""
    vocab = max(lm.vocab_size, 8)
    tokenizer = _SyntheticTokenizer(vocab)
    masking = None
    if lm.masked:
        masking = Masking(lm.mask_rate, lm.max_predictions, 4, vocab, (), opts.seed)
    row_tokens = lm.max_length if lm.masked else lm.max_length + 1

    def rows(global_rows: np.ndarray, stream: int) -> Batch:
        tokens = np.stack(
            [
                np.random.default_rng((opts.seed, stream, int(r))).integers(5, vocab, row_tokens)
                for r in global_rows
            ]
        ).astype(np.int32)
        segments = np.ones_like(tokens)
        positions = np.broadcast_to(np.arange(row_tokens, dtype=np.int32), tokens.shape).copy()
        if masking is not None:
            return masking(global_rows, tokens, segments, positions)
        return decoder_batch(tokens, segments, positions)

    def train_fn(batch_index: int) -> Batch:
        return rows(
            order.process_rows(
                batch_index, opts.global_batch, opts.process_index, opts.local_batch
            ),
            0,
        )

    share = feed.EvalShare.of(
        lm.num_eval_rows if lm.num_eval_rows >= 0 else opts.global_batch, opts
    )

    def evals() -> Iterator[Batch]:
        for indices in share.batch_indices():
            yield feed.pad_rows(rows(indices, 1), share.batch)

    return LanguageData(
        feed.TrainBatches(train_fn, opts),
        lambda: feed.Counted(evals(), share.num_batches),
        tokenizer,
    )


class _SyntheticTokenizer:
    """Ids as text, for synthetic data (benchmarks, compiles)."""

    kind = "synthetic"
    bos_id, eos_id, mask_id = 3, 1, 4

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.files: dict[str, bytes] = {}

    def encode(self, text: str) -> list[int]:
        return [int(w) for w in text.split() if w.isdigit() and int(w) < self.vocab_size]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
