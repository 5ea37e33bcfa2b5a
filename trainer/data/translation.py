"""Translation input pipeline: TFDS text pairs (or synthetic ids) -> grain batches.

Data flow for training, per process:
  TFDS array_record split --(this process's slice [i::n])--> global index shuffle,
  reshuffled every epoch --> tokenize (EOS appended) --> drop pairs longer than
  `max_length` --> pack several pairs per row (or pad one pair per row) --> batch.

It runs in this process (threads, no grain workers), is a pure function of
`seed`, `process_index` and `process_count`, and is checkpointable through the
grain iterator's `get_state()`/`set_state()`. Shuffling is grain's exact global
index shuffle, so there is no `shuffle_buffer` (the key is not read).

Sharding: process `i` of `n` owns examples `i, i+n, ...` of the split, so one
epoch over all processes is the whole (length-filtered) split for every `n`.
What depends on `n` is the order, the grouping into rows and batches, and where
epochs end (shares differ by up to one example). With packing, rows at an epoch
boundary may mix examples of two epochs.

Batches are dicts of int32 [local_batch, max_length] arrays under `FEATURE_KEYS`.
`*_segmentation` is the 1-based id of the example a token belongs to (0 on
padding); `*_position` counts tokens from 0 within each example.
"""

import dataclasses
import functools
import logging
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from trainer.data import options, tiny_translation
from trainer.data.tokenizer import (
    EOS_ID,
    FIRST_REGULAR_ID,
    SyntheticVocab,
    Vocab,
    load_or_train_sentencepiece,
)
from trainer.errors import ConfigError

_logger = logging.getLogger(__name__)

Batch = dict[str, np.ndarray]
Tokenize = Callable[[Mapping[str, Any]], Batch]
EvalFunctions = tuple[Callable[[], Iterator[Batch]], Callable[[], tuple[list[str], list[str]]]]

FEATURE_KEYS = ("inputs", "targets", "inputs_segmentation", "targets_segmentation",
                "inputs_position", "targets_position")  # fmt: skip
SYNTHETIC = "synthetic"
_LANGUAGES = ("de", "en")
# Enough prefetching to hide array_record reads and tokenization behind a
# training step, without competing with XLA for the (few) host cores.
_DEFAULT_READ_THREADS = 2
_PREFETCH_BUFFER = 128
# 500k pairs = 1M sentences: a good SentencePiece vocabulary for WMT, trained
# in minutes; smaller datasets are used whole.
_DEFAULT_VOCAB_TRAIN_PAIRS = 500_000
# Examples checked up front so a `max_length` that filters out everything fails
# at start-up instead of hanging the first `next()`.
_LENGTH_PROBE_EXAMPLES = 256


class DatasetNotPreparedError(RuntimeError):
    """The TFDS dataset is missing from `data_dir` (or not stored as array_record)."""


@dataclasses.dataclass(frozen=True)
class TranslationData:
    """The input side of a translation run, for one process.

    Attributes:
      train: Endless, checkpointable iterator of training batches.
      eval_batches: Returns a fresh finite iterable of eval batches; every
        process yields the same number, padded with all-zero rows.
      eval_references: Returns (source texts, reference texts) of this
        process's eval share, aligned with the non-padding eval rows.
      vocab: The tokenizer (PAD=0, EOS=1).
    """

    train: grain.DatasetIterator
    eval_batches: Callable[[], Iterable[Batch]]
    eval_references: Callable[[], tuple[list[str], list[str]]]
    vocab: Vocab


@dataclasses.dataclass(frozen=True)
class _Options:
    """The validated data config."""

    name: str
    data_dir: str
    source_lang: str
    target_lang: str
    vocab_path: str | None
    vocab_size: int
    max_length: int
    pack: bool
    train_split: str
    eval_split: str
    num_eval_examples: int
    prepare: bool
    read_threads: int
    vocab_train_pairs: int
    local_batch: int
    seed: int
    process_index: int
    process_count: int


def make_translation_data(
    data_config: Any,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> TranslationData:
    """Builds this process's training iterator, eval batches and vocabulary.

    Args:
      data_config: `ml_collections.ConfigDict` (or mapping) with keys name,
        data_dir, source_lang, target_lang, vocab_path, vocab_size, max_length,
        pack, eval_split, num_eval_examples; optional: train_split ("train"),
        prepare (True: build tiny_translation if missing), read_threads (2),
        vocab_train_pairs (500000).
      global_batch_size: Rows per step over all processes; must divide by
        `process_count`.
      seed: Seed of shuffling, packing and synthetic data.
      process_index: This process, in [0, process_count).
      process_count: Number of processes reading data.

    Returns:
      The `TranslationData` of this process.

    Raises:
      DatasetNotPreparedError: If a TFDS dataset is not prepared in `data_dir`.
      ValueError: On an inconsistent config.
    """
    opts = _parse_options(data_config, global_batch_size, seed, process_index, process_count)
    if opts.name == SYNTHETIC:
        return _synthetic_data(opts)
    if opts.name == tiny_translation.DATASET_NAME:
        if opts.prepare:
            tiny_translation.prepare_tiny_translation(opts.data_dir)
        elif not tiny_translation.TinyTranslation(data_dir=opts.data_dir).is_prepared():
            raise DatasetNotPreparedError(
                f"Dataset '{opts.name}' is not prepared in data_dir={opts.data_dir}: set "
                "prepare=True in the data config or call "
                f"trainer.data.tiny_translation.prepare_tiny_translation({opts.data_dir!r})."
            )
    train_source = _open_split(opts.name, opts.train_split, opts.data_dir)
    eval_source = _open_split(opts.name, opts.eval_split, opts.data_dir)
    vocab = _load_vocab(opts)
    tokenize = functools.partial(
        _tokenize, vocab=vocab, source_lang=opts.source_lang, target_lang=opts.target_lang
    )
    train = _train_iterator(train_source, tokenize, opts)
    return TranslationData(train, *_tfds_eval(eval_source, tokenize, opts), vocab)


def _parse_options(
    config: Any, global_batch_size: int, seed: int, process_index: int, process_count: int
) -> _Options:
    get = options.config_getter(config)
    local_batch = options.local_batch_size(global_batch_size, process_index, process_count)
    name = get("name")
    synthetic = name == SYNTHETIC
    opts = _Options(
        name=name,
        data_dir=options.data_dir(get("data_dir", None)),
        source_lang=get("source_lang", "en") if synthetic else get("source_lang"),
        target_lang=get("target_lang", "de") if synthetic else get("target_lang"),
        vocab_path=get("vocab_path", None),
        vocab_size=int(get("vocab_size")),
        max_length=int(get("max_length")),
        pack=bool(get("pack")),
        train_split=get("train_split", "train"),
        eval_split=get("eval_split", "validation") if synthetic else get("eval_split"),
        num_eval_examples=int(get("num_eval_examples")),
        prepare=bool(get("prepare", True)),
        read_threads=int(get("read_threads", _DEFAULT_READ_THREADS)),
        vocab_train_pairs=int(get("vocab_train_pairs", _DEFAULT_VOCAB_TRAIN_PAIRS)),
        local_batch=local_batch,
        seed=seed % 2**32,  # grain seeds are uint32.
        process_index=process_index,
        process_count=process_count,
    )
    languages = {opts.source_lang, opts.target_lang}
    if not synthetic and (len(languages) != 2 or not languages <= set(_LANGUAGES)):
        raise ConfigError(
            f"source_lang/target_lang must be two of {_LANGUAGES}, got "
            f"{opts.source_lang!r}/{opts.target_lang!r}."
        )
    if opts.max_length < 2:
        raise ConfigError(f"max_length={opts.max_length} leaves no room for a token and EOS.")
    if opts.vocab_size <= FIRST_REGULAR_ID:
        raise ConfigError(f"vocab_size={opts.vocab_size} leaves no regular ids.")
    return opts


def _not_prepared_message(name: str, data_dir: str, detail: str) -> str:
    return (
        f"TFDS dataset '{name}' {detail} in data_dir={data_dir}. Prepare it with "
        f"`tfds build {name} --file_format=array_record --data_dir={data_dir}` (needs "
        "TensorFlow and internet access on the preparing machine; copy the result here)."
    )


def _open_split(name: str, split: str, data_dir: str) -> Sequence[Mapping[str, Any]]:
    """Opens a random-access TFDS split, mapping "not prepared" to one clear error."""
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        # `from None`: TFDS's message lists every dataset it knows, burying this one.
        message = _not_prepared_message(name, data_dir, "is not found")
        raise DatasetNotPreparedError(message) from None
    try:
        return builder.as_data_source(split=split)
    except Exception as e:
        # Diagnose after the fact rather than before: `tfds.testing.mock_data`
        # fakes `as_data_source` but not the files a check would look at.
        if not builder.is_prepared():
            detail = "is not prepared"
        elif tfds.core.FileFormat.ARRAY_RECORD not in builder.info.available_file_formats():
            detail = f"is prepared as {builder.info.file_format.value}, not array_record,"
        else:
            raise
        raise DatasetNotPreparedError(_not_prepared_message(name, data_dir, detail)) from e


def _as_text(value: Any) -> str:
    # TFDS data sources return bytes; mocked ones return str.
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def _load_vocab(opts: _Options) -> Vocab:
    vocab_path = opts.vocab_path or os.path.join(
        opts.data_dir, f"{opts.name.replace('/', '_')}_spm_{opts.vocab_size}.model"
    )

    def training_texts() -> Iterator[str]:
        # The whole train split (not `train_split`, which may be a test slice):
        # the vocabulary file is shared by every run that uses this path.
        source = _open_split(opts.name, "train", opts.data_dir)
        num_pairs = min(len(source), opts.vocab_train_pairs)
        message = "Training a %d-piece vocabulary on %d %s pairs -> %s (minutes for WMT)."
        _logger.warning(message, opts.vocab_size, num_pairs, opts.name, vocab_path)
        # Evenly spaced pairs: a deterministic sample of the whole split.
        for index in np.linspace(0, len(source) - 1, num_pairs, dtype=np.int64):
            example = source[int(index)]
            yield _as_text(example[opts.source_lang])
            yield _as_text(example[opts.target_lang])

    return load_or_train_sentencepiece(
        vocab_path, opts.vocab_size, training_texts, description=f"{opts.name} train split"
    )


def _tokenize(
    example: Mapping[str, Any], *, vocab: Vocab, source_lang: str, target_lang: str
) -> Batch:
    return {
        "inputs": np.asarray(vocab.encode(_as_text(example[source_lang])), np.int32),
        "targets": np.asarray(vocab.encode(_as_text(example[target_lang])), np.int32),
    }


def _fits(example: Mapping[str, np.ndarray], max_length: int) -> bool:
    return example["inputs"].size <= max_length and example["targets"].size <= max_length


def _fill_row(batch: Batch, row: int, example: Mapping[str, np.ndarray]) -> None:
    """Writes one unpacked example into row `row` of a zero-initialised batch."""
    for key in ("inputs", "targets"):
        tokens = example[key]
        batch[key][row, : tokens.size] = tokens
        batch[f"{key}_segmentation"][row, : tokens.size] = 1
        batch[f"{key}_position"][row, : tokens.size] = np.arange(tokens.size)


def _pad_example(example: Mapping[str, np.ndarray], max_length: int) -> Batch:
    padded = {key: np.zeros((1, max_length), np.int32) for key in FEATURE_KEYS}
    _fill_row(padded, 0, example)
    return {key: value[0] for key, value in padded.items()}


def _rename_packed(row: Mapping[str, np.ndarray]) -> Batch:
    result = {}
    for key in ("inputs", "targets"):
        result[key] = row[key].astype(np.int32)
        result[f"{key}_segmentation"] = row[f"{key}_segment_ids"].astype(np.int32)
        result[f"{key}_position"] = row[f"{key}_positions"].astype(np.int32)
    return result


def _train_iterator(
    source: Sequence[Mapping[str, Any]], tokenize: Tokenize, opts: _Options
) -> grain.DatasetIterator:
    shard = grain.MapDataset.source(source)[opts.process_index :: opts.process_count]
    if len(shard) == 0:
        raise ConfigError(
            f"Split '{opts.train_split}' of {opts.name} has {len(source)} examples, none for "
            f"process {opts.process_index} of {opts.process_count}."
        )
    probe = [tokenize(shard[i]) for i in range(min(len(shard), _LENGTH_PROBE_EXAMPLES))]
    if not any(_fits(example, opts.max_length) for example in probe):
        raise ConfigError(
            f"No {opts.name} training pair among the first {len(probe)} fits "
            f"max_length={opts.max_length}; raise max_length."
        )
    examples = (
        shard.shuffle(seed=opts.seed)
        .repeat()  # Endless; the shuffle above is reseeded every epoch.
        .map(tokenize)
        .filter(functools.partial(_fits, max_length=opts.max_length))
    )
    rows = examples.to_iter_dataset(
        grain.ReadOptions(num_threads=opts.read_threads, prefetch_buffer_size=_PREFETCH_BUFFER)
    )
    if opts.pack:
        rows = grain.experimental.FirstFitPackIterDataset(
            rows,
            length_struct={"inputs": opts.max_length, "targets": opts.max_length},
            # One packing round fills about one local batch of rows.
            num_packing_bins=opts.local_batch,
            seed=opts.seed,
            shuffle_bins=True,
        ).map(_rename_packed)
    else:
        rows = rows.map(functools.partial(_pad_example, max_length=opts.max_length))
    return iter(rows.batch(opts.local_batch, drop_remainder=True))


def _eval_functions(
    examples: Sequence[Batch], references: tuple[list[str], list[str]], total: int, opts: _Options
) -> EvalFunctions:
    """Returns (eval_batches, eval_references) over this process's tokenized share."""
    # Sized by the largest share so that every process runs the same number of
    # (collective) eval steps; smaller shares end with all-zero rows.
    num_batches = math.ceil(math.ceil(total / opts.process_count) / opts.local_batch)

    def eval_batches() -> Iterator[Batch]:
        for start in range(0, num_batches * opts.local_batch, opts.local_batch):
            batch = {
                k: np.zeros((opts.local_batch, opts.max_length), np.int32) for k in FEATURE_KEYS
            }
            for row, example in enumerate(examples[start : start + opts.local_batch]):
                _fill_row(batch, row, example)
            yield batch

    def eval_references() -> tuple[list[str], list[str]]:
        return list(references[0]), list(references[1])

    return eval_batches, eval_references


def _truncate(tokens: np.ndarray, max_length: int) -> np.ndarray:
    if tokens.size <= max_length:
        return tokens
    # Keep EOS so that a truncated example still looks like a complete one.
    return np.append(tokens[: max_length - 1], np.int32(EOS_ID))


def _tfds_eval(
    source: Sequence[Mapping[str, Any]], tokenize: Tokenize, opts: _Options
) -> EvalFunctions:
    total = len(source)
    if opts.num_eval_examples >= 0:
        total = min(total, opts.num_eval_examples)
    raw = [source[i] for i in range(opts.process_index, total, opts.process_count)]
    examples = [
        {key: _truncate(tokens, opts.max_length) for key, tokens in tokenize(ex).items()}
        for ex in raw
    ]
    references = (
        [_as_text(ex[opts.source_lang]) for ex in raw],
        [_as_text(ex[opts.target_lang]) for ex in raw],
    )
    return _eval_functions(examples, references, total, opts)


def _synthetic_example(
    index: int, *, seed: int, stream: int, vocab_size: int, max_length: int
) -> Batch:
    """Full-length random pair number `index` of `stream` (0 train, 1 eval)."""
    rng = np.random.default_rng((seed, stream, index))
    tokens = rng.integers(FIRST_REGULAR_ID, vocab_size, size=(2, max_length), dtype=np.int32)
    tokens[:, -1] = EOS_ID
    return _pad_example({"inputs": tokens[0], "targets": tokens[1]}, max_length)


def _synthetic_data(opts: _Options) -> TranslationData:
    """Random full-length pairs for throughput benchmarks; no files, deterministic."""
    vocab = SyntheticVocab(opts.vocab_size)
    make = functools.partial(
        _synthetic_example, seed=opts.seed, vocab_size=opts.vocab_size, max_length=opts.max_length
    )
    # Process i generates global example numbers i, i+n, ...: the global stream
    # is the same for any process_count.
    train = (
        grain.MapDataset.range(opts.process_index, np.iinfo(np.int64).max, opts.process_count)
        .map(functools.partial(make, stream=0))
        .to_iter_dataset(grain.ReadOptions(num_threads=opts.read_threads))
        .batch(opts.local_batch, drop_remainder=True)
    )
    total = opts.num_eval_examples
    if total < 0:
        total = opts.local_batch * opts.process_count
    examples = [make(i, stream=1) for i in range(opts.process_index, total, opts.process_count)]
    references = (
        [vocab.decode(ex["inputs"]) for ex in examples],
        [vocab.decode(ex["targets"]) for ex in examples],
    )
    return TranslationData(iter(train), *_eval_functions(examples, references, total, opts), vocab)
