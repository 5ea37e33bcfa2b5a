"""A language model's input pipeline: this process's training batches, eval batches and
tokenizer from the data config (your files, the embedded corpus, a token store, or
random tokens); and the token store's writer."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np

from trainer import console
from trainer.errors import ConfigError
from trainer.input import chat_template as chat_template_lib
from trainer.input import corpus, feed, options, order, text_files, token_store
from trainer.input import tokenizer as tokenizer_lib
from trainer.input.builders import tiny_text
from trainer.input.language import chat
from trainer.input.language import documents as documents_lib
from trainer.input.language.features import Batch, Masking, TrainBatchFn, decoder_batch, rows_batch
from trainer.input.language.options import SYNTHETIC, LanguageOptions, read_options
from trainer.input.language.stream import DocumentStream, PackedDocuments
from trainer.input.options import DataOptions
from trainer.workdir import storage


@dataclasses.dataclass(frozen=True)
class LanguageData:
    """The input side of a language-model run, for one process.

    Attributes:
      train: endless iterator of training batches with a global position.
      eval_batches: returns a fresh finite iterable of eval batches.
      tokenizer: the run's tokenizer.
      input_record: what the training documents are (their files, bytes and count,
        and a digest of their contents), recorded for a resume to compare.
      samples: ``n`` -> up to ``n`` ``(prompt ids, held-out continuation ids)`` of
        eval documents, to show what the model learnt (none for random tokens): a
        document's beginning and what follows, or a conversation up to its last
        answer (with the generation prompt) and that answer.
      chat_template: the template conversations are rendered with (chat data only).
      stop_ids: the ids a generated continuation ends at (EOS; a chat template's end
        of turn too).
      rows_per_epoch: the training rows of one pass over the documents (0: endless).
    """

    train: feed.TrainBatches
    eval_batches: Callable[[], Iterable[Batch]]
    tokenizer: tokenizer_lib.TextTokenizer
    input_record: dict = dataclasses.field(default_factory=dict)
    samples: Callable[[int], list[tuple[np.ndarray, np.ndarray]]] = lambda n: []
    chat_template: chat_template_lib.ChatTemplate | None = None
    stop_ids: tuple[int, ...] = ()
    rows_per_epoch: int = 0


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
    if opts.name == chat.NAME:
        return _chat_data(lm, opts)
    if opts.name == tiny_text.DATASET_NAME:
        lm = _on_tiny_text(lm, opts.data_dir)
    elif opts.name != text_files.NAME:
        raise ConfigError(
            f"data.name={opts.name!r}: a language model reads '{text_files.NAME}' (your "
            f"files), '{chat.NAME}' (your conversations), '{tiny_text.DATASET_NAME}' (the "
            f"embedded corpus) or '{SYNTHETIC}'"
        )
    tokenizer, train_docs, eval_docs, record = _documents(lm, opts)
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
    if train_docs is None:  # evaluation only: a model of its own tokenizer, on eval_files
        train = feed.TrainBatches(_no_training, opts)
    else:
        plan = DocumentStream(train_docs.lengths, row_tokens, lm.max_length, opts.seed)
        train = feed.TrainBatches(TrainBatchFn(train_docs, plan, opts, masking), opts)
    evals = _eval_batches(
        eval_docs,
        DocumentStream(eval_docs.lengths, row_tokens, lm.max_length, None),
        lm,
        opts,
        masking,
    )
    return LanguageData(
        train,
        evals,
        tokenizer,
        record,
        lambda n: documents_lib.document_prompts(
            eval_docs.tokens(range(min(n, len(eval_docs.lengths))))
        ),
        stop_ids=tuple(tokenizer.stop_ids),
        rows_per_epoch=plan.rows_per_epoch if train_docs is not None else 0,
    )


def _chat_data(lm: LanguageOptions, opts: DataOptions) -> LanguageData:
    """Conversations (:mod:`trainer.input.language.chat`) rendered with the model's chat
    template, whole ones packed into rows, the loss on their answers."""
    if not lm.tokenizer:
        raise ConfigError(
            f"data.name='{chat.NAME}' renders conversations with the model's chat template: "
            "name its tokenizer's directory, data.tokenizer=DIR (configs/llama.py:hf=DIR,chat "
            "does)"
        )
    tokenizer = tokenizer_lib.load_text_tokenizer(lm.tokenizer)
    specials = chat_template_lib.tokenizer_specials(tokenizer)
    template = chat_template_lib.load_chat_template(lm.tokenizer, specials)
    encoder = chat.ChatEncoder(template, tokenizer, lm.train_on_prompts)
    conversations = chat.read_conversations(lm.train_files, "data.train_files")
    record = _input_record(conversations.files, conversations.digest, len(conversations))
    if lm.eval_files:
        _check_apart(lm)
        held = chat.read_conversations(lm.eval_files, "data.eval_files")
    else:
        train, held_indices = _hold_out(len(conversations), lm, opts, "conversations")
        conversations, held = (
            _conversation_subset(conversations, indices, f"{lm.eval_holdout}-{opts.seed}-{p}")
            for p, indices in (("train", train), ("held", held_indices))
        )
    docs = {}
    for key, part in (("data.train_files", conversations), ("data.eval_files", held)):
        counts = chat.conversation_lengths(opts.data_dir, part, encoder)
        docs[key] = chat.ChatDocuments(part, encoder, counts, lm.max_length, key)
    train_docs, eval_docs = docs["data.train_files"], docs["data.eval_files"]
    row_tokens = lm.max_length + 1
    plan = PackedDocuments(train_docs.lengths, row_tokens, opts.seed)
    train = feed.TrainBatches(TrainBatchFn(train_docs, plan, opts, None), opts)
    evals = _eval_batches(
        eval_docs, PackedDocuments(eval_docs.lengths, row_tokens, None), lm, opts, None
    )
    stops = chat_template_lib.stop_ids(template, tokenizer)

    def samples(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
        out = []
        for j in range(min(n, len(eval_docs.lengths))):
            messages = eval_docs.conversations[int(eval_docs.index[j])].messages
            last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
            answer, _ = tokenizer.encode_offsets(messages[last]["content"])
            out.append((encoder.prompt_ids(messages[:last]), np.asarray(answer, np.int32)))
        return out

    return LanguageData(
        train, evals, tokenizer, record, samples, template, stops, plan.rows_per_epoch
    )


def _conversation_subset(conversations: chat.Conversations, indices, tag: str):
    """Some of ``conversations``, with a digest of its own (it names their caches)."""
    return dataclasses.replace(
        conversations,
        items=[conversations.items[int(i)] for i in indices],
        digest=hashlib.sha256(f"{conversations.digest}/{tag}".encode()).hexdigest()[:16],
    )


def _documents(lm: LanguageOptions, opts: DataOptions):
    """``(tokenizer, training documents, eval documents, input record)``: the eval
    documents are ``data.eval_files``'s, refused where they share a file with the
    training documents, or without them a held-out share of the training documents
    (the tokenizer, where one is trained, learns from the rest only). Without training
    files, a configured tokenizer and eval files give an evaluation only (no training
    documents: asking for a training batch is an error)."""
    reading = text_files.Reading(lm.document, lm.text_field, "data.train_files")
    held = None
    if not lm.train_files and not lm.tokenized_dir and lm.eval_files and lm.tokenizer:
        # Evaluating a model that brings its tokenizer needs no training documents.
        tokenizer, train_docs, record = tokenizer_lib.load_text_tokenizer(lm.tokenizer), None, {}
    elif lm.tokenized_dir:
        store = token_store.TokenStore(lm.tokenized_dir)
        tokenizer, train_docs = store.tokenizer, store
        record = _input_record(
            store.manifest.get("sources", []), _store_digest(store), len(store.lengths)
        )
        if not lm.eval_files:
            train, held = _hold_out(len(store.lengths), lm, opts)
            train_docs = documents_lib.DocumentSubset(store, train)
            held = documents_lib.DocumentSubset(store, held)
    else:
        documents = text_files.read(lm.train_files, reading)
        record = _input_record(documents.files, documents.digest, len(documents))
        if not lm.eval_files:
            train, held_indices = _hold_out(len(documents), lm, opts)
            documents, held = (
                _text_subset(documents, indices, f"{lm.eval_holdout}-{opts.seed}-{part}")
                for part, indices in (("train", train), ("held", held_indices))
            )
        tokenizer = documents_lib.tokenizer_for(lm, documents, opts.data_dir)
        lengths = documents_lib.document_lengths(opts.data_dir, documents, tokenizer)
        train_docs = documents_lib.TextDocuments(documents, tokenizer, lengths)
        if held is not None:
            held_lengths = documents_lib.document_lengths(opts.data_dir, held, tokenizer)
            held = documents_lib.TextDocuments(held, tokenizer, held_lengths)
    if held is not None:
        return tokenizer, train_docs, held, record
    if train_docs is not None and not lm.tokenized_dir:
        _check_apart(lm)
    eval_reading = dataclasses.replace(reading, key="data.eval_files")
    eval_docs = text_files.read(lm.eval_files, eval_reading)
    eval_lengths = documents_lib.document_lengths(opts.data_dir, eval_docs, tokenizer)
    eval_docs = documents_lib.TextDocuments(eval_docs, tokenizer, eval_lengths)
    return tokenizer, train_docs, eval_docs, record


def _no_training(batch_index: int) -> Batch:
    raise ConfigError("data.train_files is empty: give the documents to train on")


def _input_record(files, corpus_digest: str, documents: int) -> dict:
    """What the training documents are: their files with their sizes, their count and
    a digest of their contents."""
    sizes = []
    for name in files:
        try:
            sizes.append([str(name), storage.path(name).stat().length])
        except OSError:
            sizes.append([str(name), 0])
    return {"corpus": corpus_digest, "files": sizes, "documents": documents}


def _store_digest(store: token_store.TokenStore) -> str:
    """A token store's digest: of its manifest (its sources, tokenizer and counts)."""
    return hashlib.sha256(json.dumps(store.manifest, sort_keys=True).encode()).hexdigest()[:16]


def _hold_out(count: int, lm: LanguageOptions, opts: DataOptions, what: str = "documents"):
    train, held = documents_lib.hold_out(count, lm.eval_holdout, opts.seed)
    if opts.process_index == 0:
        console.say(
            f"evaluating on {len(held):,} of the {count:,} {what} of data.train_files, "
            f"held out ({lm.eval_holdout:.1%}, data.eval_holdout; or give data.eval_files)"
        )
    return train, held


def _text_subset(documents: text_files.Documents, indices, tag: str) -> text_files.Documents:
    """Some of ``documents``, with a digest of its own (it names their caches)."""
    return dataclasses.replace(
        documents,
        texts=[documents.texts[int(i)] for i in indices],
        digest=hashlib.sha256(f"{documents.digest}/{tag}".encode()).hexdigest()[:16],
    )


def _check_apart(lm: LanguageOptions) -> None:
    """Refuses eval files that are training files too: the eval loss would be a
    training loss."""
    train = {str(p) for p in corpus.expand(lm.train_files, "data.train_files")}
    both = [str(p) for p in corpus.expand(lm.eval_files, "data.eval_files") if str(p) in train]
    if both:
        raise ConfigError(
            f"data.eval_files and data.train_files share {len(both)} file(s) ({both[0]}): "
            "the evaluation would be on training documents (name other eval files, or leave "
            "data.eval_files empty to hold out data.eval_holdout of the training documents)"
        )


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
    if opts.process_index == 0:
        every = "all" if total == plan.rows_per_epoch else f"{total:,}"
        console.say(
            f"evaluation: {every} of the {plan.rows_per_epoch:,} rows of {lm.max_length} tokens "
            "the eval documents make (data.num_eval_rows; -1 = all)"
        )
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
