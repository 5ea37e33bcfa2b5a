"""A language model's input pipeline: this process's training batches, eval batches and
tokenizer from the data config (your files, the embedded corpus, a token store, or
random tokens); and the token store's writer."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from trainer.errors import ConfigError
from trainer.input import corpus, feed, options, order, text_files, token_store
from trainer.input import tokenizer as tokenizer_lib
from trainer.input.builders import tiny_text
from trainer.input.language import documents as documents_lib
from trainer.input.language.features import Batch, Masking, TrainBatchFn, decoder_batch, rows_batch
from trainer.input.language.options import SYNTHETIC, LanguageOptions, read_options
from trainer.input.language.stream import DocumentStream
from trainer.input.options import DataOptions
from trainer.workdir import storage


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
        tokenizer = documents_lib.tokenizer_for(lm, documents, opts.data_dir)
        lengths = documents_lib.document_lengths(opts.data_dir, documents, tokenizer)
        train_docs = documents_lib.TextDocuments(documents, tokenizer, lengths)
    documents_lib.check_tokenizer(tokenizer, lm)
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
    plan = DocumentStream(train_docs.lengths, row_tokens, lm.max_length, opts.seed)
    train = feed.TrainBatches(TrainBatchFn(train_docs, plan, opts, masking), opts)
    eval_reading = dataclasses.replace(reading, key="data.eval_files")
    eval_docs = text_files.read(lm.eval_files, eval_reading)
    eval_lengths = documents_lib.document_lengths(opts.data_dir, eval_docs, tokenizer)
    evals = _eval_batches(
        documents_lib.TextDocuments(eval_docs, tokenizer, eval_lengths),
        DocumentStream(eval_lengths, row_tokens, lm.max_length, None),
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
        sample = documents_lib.sample(text_files.iter_documents(files, reading, _skipped(), digest))
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


def _eval_batches(documents, plan: DocumentStream, lm: LanguageOptions, opts: DataOptions, masking):
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
