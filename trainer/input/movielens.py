"""MovieLens input pipeline for NCF: TFDS ratings -> implicit feedback -> batches.

Data flow: the ratings split of `movielens/20m-ratings`, `local_movielens` or
`tiny_movielens` --> user_id, movie_id and timestamp of every rating --> implicit
feedback: every rating is an interaction, a pair rated twice counts once (at its
latest time) --> users with < 2 interactions are dropped (nothing to hold out and
train on) --> raw ids to dense ids 0..N-1 in sorted order (numeric if all ids are
decimal, else text; items count only if a kept user has them) --> leave-one-out:
each user's latest interaction (largest timestamp, ties to the larger item id) is
the eval positive, the rest are training positives.

A training epoch is every training positive once plus `num_negatives` negatives
per positive: row x of G = P * (1 + num_negatives) is positive x // (1 +
num_negatives) itself if x % (1 + num_negatives) == 0, else a negative for that
positive's user (`trainer.input.negatives`). Global row r is row `permute(r mod G)`
of epoch `r // G` (`trainer.input.order`), so a batch is computed, vectorised, from
its index alone, the same for any number of processes or workers.

Every process reads all ratings (dense ids, leave-one-out and the sampler need
every user's interactions), then produces only its rows; eval users are shared
out i, i+n, ... Each user's eval negatives are distinct and depend only on (seed,
user).

Cost at MovieLens-20M scale: see `python -m trainer.data.bench --config
configs/ncf_16.py:local_20m` (reading and parsing the records dominates start-up).
"""

import dataclasses
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module
from tensorflow_datasets.proto import tf_example_pb2

from trainer.errors import ConfigError
from trainer.input import feed, options, order, ratings, source
from trainer.input.negatives import NegativeSampler
from trainer.input.options import DataOptions

Batch = dict[str, np.ndarray]
TRAIN_KEYS = ("users", "items", "labels", "weights")
EVAL_KEYS = ("users", "items", "weights")
_READ_CHUNK = 65_536  # Records parsed per batched read: bounds memory, amortises calls.
# Streams of the counter-based hash, so the random numbers of different uses never meet.
_SHUFFLE, _TRAIN_NEGATIVES, _EVAL_NEGATIVES = 1, 2, 3


@dataclasses.dataclass(frozen=True)
class MovieLensData:
    """The input side of an NCF run, for one process.

    Attributes:
      train: Endless iterator of training batches with a global position
        (`feed.TrainBatches`): "users", "items" int32 [b], "labels" float32 [b]
        (1 positive, 0 negative), "weights" float32 [b] (ones).
      eval_batches: Returns a fresh finite iterable of eval batches, one user a row:
        "users" int32 [b], "items" int32 [b, 1 + num_eval_negatives] (held-out positive
        in column 0), "weights" float32 [b]. Every process yields the same number of
        batches; padding rows are all zero with weight 0.
      num_users: Users after dropping those with < 2 interactions (dense ids below this).
      num_items: Items with an interaction by a kept user (dense ids below this).
      train_examples_per_epoch: Rows of one epoch over all processes,
        training positives * (1 + num_negatives).
    """

    train: feed.TrainBatches
    eval_batches: Callable[[], Iterator[Batch]]
    num_users: int
    num_items: int
    train_examples_per_epoch: int


@dataclasses.dataclass(frozen=True)
class MovieLensOptions:
    """The MovieLens-specific keys of the data config."""

    num_negatives: int
    num_eval_negatives: int


def make_movielens_data(data_config: Any, opts: DataOptions) -> MovieLensData:
    """Builds this process's training iterator and eval batches.

    Args:
      data_config: the `data` config section: the `DataOptions` keys (name:
        "movielens/20m-ratings", "local_movielens", "tiny_movielens" or another
        MovieLens ratings config) and num_negatives, num_eval_negatives.
      opts: The options every pipeline shares (`DataOptions.from_config`).

    Returns:
      The `MovieLensData` of this process.

    Raises:
      DatasetNotPreparedError: If the TFDS dataset is not prepared in `data_dir`.
      ConfigError: On an inconsistent config, or data that leaves nothing to train on.
    """
    ml_opts = MovieLensOptions(
        **options.read(data_config, {"num_negatives": int, "num_eval_negatives": int})
    )
    if ml_opts.num_negatives < 1 or ml_opts.num_eval_negatives < 1:
        raise ConfigError(
            f"num_negatives={ml_opts.num_negatives} and num_eval_negatives="
            f"{ml_opts.num_eval_negatives} must be >= 1."
        )
    ratings = source.open_split(
        opts.name,
        opts.train_split,
        opts.data_dir,
        deserialize_method=tfds.decode.DeserializeMethod.RAW_BYTES,  # Parsed below.
    )
    data = _leave_one_out(*_read_columns(ratings, opts.name), opts.name)
    sampler = NegativeSampler(data["all_users"], data["all_items"], data["num_items"])
    sampler.check_feasible(ml_opts.num_eval_negatives, opts.name)
    train = TrainBatchFn(data["train_users"], data["train_items"], sampler, opts, ml_opts)
    return MovieLensData(
        train=feed.TrainBatches(train, opts),
        eval_batches=_eval_function(data["eval_items"], sampler, opts, ml_opts),
        num_users=len(data["eval_items"]),
        num_items=data["num_items"],
        train_examples_per_epoch=train.global_size,
    )


def _read_columns(source: Sequence[bytes], name: str) -> tuple[np.ndarray, ...]:
    """(user ids, movie ids, timestamps) of every record.

    Ids are int64 when every record's ids are plain decimal numbers (parsed vectorised,
    `trainer.input.ratings`), else byte strings (parsed with protobuf).
    """
    if not len(source):
        raise ConfigError(f"The train split of '{name}' is empty.")
    columns = tuple(np.empty(len(source), np.int64) for _ in range(3))  # No concatenation.
    start = 0
    for records in record_chunks(source):
        parsed = ratings.parse_chunk(records)
        if parsed is None:
            return _read_columns_slowly(source, name)
        for column, values in zip(columns, parsed, strict=True):
            column[start : start + len(values)] = values
        start += len(values)
    return columns


def record_chunks(source: Sequence[bytes]) -> Iterator[list[bytes]]:
    """The serialized records of `source` in order, in chunks of up to `_READ_CHUNK`.

    A TFDS array_record split on a local disk is read shard by shard in ranges, ~3x
    faster than by index (TFDS's per-record path); other sources by index.
    """
    info, split = getattr(source, "dataset_info", None), getattr(source, "split", None)
    instructions = info.splits[split].file_instructions if info and split else []
    if not instructions or any("://" in os.fspath(i.filename) for i in instructions):
        for start in range(0, len(source), _READ_CHUNK):
            yield _records(source, start)
        return
    for instruction in instructions:
        reader = array_record_module.ArrayRecordReader(os.fspath(instruction.filename))
        end = instruction.skip + instruction.take
        for start in range(instruction.skip, end, _READ_CHUNK):
            yield reader.read(start, min(end, start + _READ_CHUNK))
        reader.close()


def _records(source: Sequence[bytes], start: int) -> list[bytes]:
    keys = range(start, min(len(source), start + _READ_CHUNK))
    # Batched reads are ~8x faster than one by one; plain sequences have only the latter.
    getitems = getattr(source, "__getitems__", None)
    return getitems(keys) if getitems else [source[i] for i in keys]


def _read_columns_slowly(source: Sequence[bytes], name: str) -> tuple[np.ndarray, ...]:
    """`_read_columns` through protobuf, ids as byte strings (~4 us a record)."""
    users, items, times = [], [], []
    for records in record_chunks(source):
        chunk_users, chunk_items, chunk_times = [], [], []
        try:
            for record in records:
                feature = tf_example_pb2.Example.FromString(record).features.feature
                chunk_users.append(feature["user_id"].bytes_list.value[0])
                chunk_items.append(feature["movie_id"].bytes_list.value[0])
                chunk_times.append(feature["timestamp"].int64_list.value[0])
        except IndexError:
            raise ConfigError(
                f"A record of '{name}' lacks a user_id, movie_id or timestamp value: not a "
                "MovieLens ratings dataset."
            ) from None
        # Per chunk, so that only numpy arrays (not Python objects) outlive the chunk.
        users.append(np.array(chunk_users, dtype=bytes))
        items.append(np.array(chunk_items, dtype=bytes))
        times.append(np.array(chunk_times, dtype=np.int64))
    return np.concatenate(users), np.concatenate(items), np.concatenate(times)


def _codes(raw: np.ndarray) -> np.ndarray:
    """int64 codes of ids (integers, or byte strings ordered numerically if all are
    decimal, else as text)."""
    values = raw
    if raw.dtype.kind == "S":
        try:
            numbers = raw.astype(np.int64)
            # Round trip, so that e.g. "7" and "07" stay different ids.
            if (numbers.astype(raw.dtype) == raw).all():
                values = numbers
        except ValueError:
            pass  # Not all decimal: text order.
    return np.unique(values, return_inverse=True)[1].astype(np.int32)


def _argsort_rows(*columns: np.ndarray) -> np.ndarray:
    """The stable order of rows sorted by the columns (first = most significant).

    Non-negative columns are packed into one int64 key when their bit widths fit (3x
    faster than np.lexsort on 20M rows); otherwise np.lexsort.
    """
    lows = [int(c.min()) for c in columns]
    widths = [max(1, int(c.max()) - low).bit_length() for c, low in zip(columns, lows, strict=True)]
    if sum(widths) > 63:
        return np.lexsort(columns[::-1])
    key = np.zeros(len(columns[0]), np.int64)
    for column, low, width in zip(columns, lows, widths, strict=True):
        key = (key << width) | (column.astype(np.int64) - low)
    return np.argsort(key, kind="stable")


def _runs_end(*columns: np.ndarray) -> np.ndarray:
    """True at the last element of every run of equal tuples in sorted columns."""
    end = np.ones(len(columns[0]), bool)
    end[:-1] = np.logical_or.reduce([c[1:] != c[:-1] for c in columns])
    return end


def _leave_one_out(
    raw_users: np.ndarray, raw_items: np.ndarray, times: np.ndarray, name: str
) -> dict[str, Any]:
    """Dense ids and the leave-one-out split (see the module docstring)."""
    users, items = _codes(raw_users), _codes(raw_items)
    order = _argsort_rows(users, items, times)
    users, items, times = users[order], items[order], times[order]
    latest = _runs_end(users, items)  # One interaction per (user, item): the latest.
    users, items, times = users[latest], items[latest], times[latest]
    keep = np.bincount(users)[users] >= 2
    if not keep.any():
        raise ConfigError(
            f"No user of '{name}' has interacted with 2 or more distinct items: nothing to "
            "hold out for evaluation and train on."
        )
    # int32 ids: the 20M-row columns are the bulk of start-up memory.
    users = np.unique(users[keep], return_inverse=True)[1].astype(np.int32)
    item_ids, items = np.unique(items[keep], return_inverse=True)
    items, times = items.astype(np.int32), times[keep]
    order = _argsort_rows(users, times, items)  # Last of each user: latest, then largest id.
    users, items = users[order], items[order]
    held_out = _runs_end(users)
    return {
        "num_items": len(item_ids),
        "all_users": users,
        "all_items": items,
        "eval_items": items[held_out],  # Indexed by user: users run 0..num_users-1.
        "train_users": users[~held_out],
        "train_items": items[~held_out],
    }


class TrainBatchFn:
    """This process's rows of a global training batch, computed from its index alone."""

    def __init__(
        self,
        users: np.ndarray,
        items: np.ndarray,
        sampler: NegativeSampler,
        opts: DataOptions,
        ml_opts: MovieLensOptions,
    ) -> None:
        # int32 halves what is copied to each worker process.
        self.users, self.items = users.astype(np.int32), items.astype(np.int32)
        self.sampler, self.opts = sampler, opts
        self.group = 1 + ml_opts.num_negatives  # A positive and its negatives.
        self.global_size = len(users) * self.group

    def __call__(self, batch_index: int) -> Batch:
        opts = self.opts
        rows = order.process_rows(
            batch_index, opts.global_batch, opts.process_index, opts.local_batch
        )
        epoch, row = order.epoch_order(rows, self.global_size, opts.seed, _SHUFFLE)
        positive, slot = np.divmod(row, self.group)
        users, items = self.users[positive], self.items[positive]
        negative = np.flatnonzero(slot > 0)
        key = order.hash64(opts.seed, _TRAIN_NEGATIVES, epoch[negative], row[negative])
        items[negative] = self.sampler.sample(users[negative], key)
        return {
            "users": users,
            "items": items,
            "labels": (slot == 0).astype(np.float32),
            "weights": np.ones(len(rows), np.float32),
        }


def _eval_function(
    eval_items: np.ndarray, sampler: NegativeSampler, opts: DataOptions, ml_opts: MovieLensOptions
) -> Callable[[], Iterator[Batch]]:
    """Returns eval_batches() over this process's users, i, i+n, ..."""
    share = feed.EvalShare.of(len(eval_items), opts)
    users = share.indices
    key = order.hash64(opts.seed, _EVAL_NEGATIVES, users)
    negatives = sampler.sample_distinct(users, ml_opts.num_eval_negatives, key)
    items = np.empty((len(users), 1 + ml_opts.num_eval_negatives), np.int32)  # 0.55 GB for ML-20M
    items[:, 0], items[:, 1:] = eval_items[users], negatives
    del negatives

    def eval_batches() -> Iterator[Batch]:
        return feed.Counted(_eval_batches(), share.num_batches)

    def _eval_batches() -> Iterator[Batch]:
        start = 0
        for indices in share.batch_indices():
            rows = slice(start, start + len(indices))
            start += len(indices)
            batch = {
                "users": indices.astype(np.int32),
                "items": items[rows],
                "weights": np.ones(len(indices), np.float32),
            }
            yield feed.pad_rows(batch, share.batch)

    return eval_batches
