"""MovieLens input pipeline for NCF: TFDS ratings -> implicit feedback -> grain batches.

Data flow: the "train" split (MovieLens has no other) of `movielens/20m-ratings` or
`tiny_movielens` --> user_id, movie_id and timestamp of every rating --> implicit feedback:
every rating is an interaction, a pair rated twice counts once (at its latest time) -->
users with < 2 interactions are dropped (nothing to hold out and train on) --> raw ids to
dense ids 0..N-1 in sorted order (numeric if all ids are decimal, else text; items count
only if a kept user has them) --> leave-one-out: each user's latest interaction (largest
timestamp, ties to the larger item id) is the eval positive, the rest are training positives.

A training epoch is every training positive once plus `num_negatives` negatives per
positive: row x of G = P * (1 + num_negatives) is positive x // (1 + num_negatives) itself
if x % (1 + num_negatives) == 0, else a negative for that positive's user. Rows are
reshuffled every epoch by an exact random-access permutation (a keyed Feistel network with
cycle walking), so a batch is computed, vectorised, from its index alone, and grain's
iterator state (an index) is the whole checkpoint.

Sharding: every process reads all ratings (dense ids, leave-one-out and the sampler need
every user's interactions), then produces only its share: process i of n owns training rows
i, i+n, ... of each epoch and eval users i, i+n, ... A row and its negative depend only on
(seed, epoch, row), so an epoch's examples do not depend on n; order and batching do.

Negatives are uniform over the items a user never interacted with (train or eval): uniform
candidates from a counter-based hash of (seed, stream, epoch, row, attempt), rejected while
they hit a positive (binary search in the sorted user * num_items + item keys). Training
negatives are drawn with replacement; each user's eval negatives are distinct and depend
only on (seed, user).

Cost (MovieLens-20M, measured on one slow core): parsing is ~10 us a record, so start-up
takes a few minutes per process and ~1 GB; 1M training rows take ~1 s to build (grain
prefetches on `read_threads` threads); 999 distinct eval negatives for 138k users take
~35 s / n and 0.55 GB / n, computed once.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.proto import tf_example_pb2

from trainer.data import options, tiny_movielens
from trainer.data.translation import DatasetNotPreparedError
from trainer.errors import ConfigError

Batch = dict[str, np.ndarray]
TRAIN_KEYS = ("users", "items", "labels", "weights")
EVAL_KEYS = ("users", "items", "weights")
_DEFAULT_READ_THREADS = 2
_PREFETCH_BATCHES = 4
_READ_CHUNK = 65_536  # Records parsed per batched read: bounds memory, amortises calls.
_SAMPLE_CHUNK = 1 << 22  # Candidates per vectorised eval-negative round.
_ENDLESS = 1 << 40  # Batches of the "endless" training iterator.
# Streams of the counter-based hash, so the random numbers of different uses never meet.
_SHUFFLE, _TRAIN_NEGATIVES, _EVAL_NEGATIVES = 1, 2, 3
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


@dataclasses.dataclass(frozen=True)
class MovieLensData:
    """The input side of an NCF run, for one process.

    Attributes:
      train: Endless, checkpointable iterator of training batches: "users", "items" int32
        [b], "labels" float32 [b] (1 positive, 0 negative), "weights" float32 [b] (ones).
      eval_batches: Returns a fresh finite iterable of eval batches, one user a row:
        "users" int32 [b], "items" int32 [b, 1 + num_eval_negatives] (held-out positive
        in column 0), "weights" float32 [b]. Every process yields the same number of
        batches; padding rows are all zero with weight 0.
      num_users: Users after dropping those with < 2 interactions (dense ids below this).
      num_items: Items with an interaction by a kept user (dense ids below this).
      train_examples_per_epoch: Rows of one epoch over all processes,
        training positives * (1 + num_negatives).
    """

    train: grain.DatasetIterator
    eval_batches: Callable[[], Iterator[Batch]]
    num_users: int
    num_items: int
    train_examples_per_epoch: int


@dataclasses.dataclass(frozen=True)
class _Options:
    name: str
    data_dir: str
    num_negatives: int
    num_eval_negatives: int
    prepare: bool
    read_threads: int
    local_batch: int
    seed: int
    process_index: int
    process_count: int


def make_movielens_data(
    data_config: Any,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> MovieLensData:
    """Builds this process's training iterator and eval batches.

    Args:
      data_config: `ml_collections.ConfigDict` (or mapping) with keys name
        ("movielens/20m-ratings", "tiny_movielens" or another MovieLens ratings config),
        data_dir, num_negatives, num_eval_negatives; optional: prepare (True: build
        tiny_movielens if missing), read_threads (2).
      global_batch_size: Rows per step over all processes (train and eval); must divide
        by `process_count`.
      seed: Seed of shuffling and of the negatives.
      process_index: This process, in [0, process_count).
      process_count: Number of processes reading data.

    Returns:
      The `MovieLensData` of this process.

    Raises:
      DatasetNotPreparedError: If the TFDS dataset is not prepared in `data_dir`.
      ConfigError: On an inconsistent config, or data that leaves nothing to train on.
    """
    opts = _parse_options(data_config, global_batch_size, seed, process_index, process_count)
    users, items, times = _read_columns(_open_ratings(opts), opts.name)
    data = _leave_one_out(users, items, times, opts.name)
    sampler = NegativeSampler(data["all_users"], data["all_items"], data["num_items"])
    sampler.check_feasible(opts.num_eval_negatives, opts.name)
    train = _TrainBatches(data["train_users"], data["train_items"], sampler, opts)
    read = grain.ReadOptions(num_threads=opts.read_threads, prefetch_buffer_size=_PREFETCH_BATCHES)
    rows = grain.MapDataset.range(_ENDLESS).map(train).to_iter_dataset(read)
    return MovieLensData(
        train=iter(rows),
        eval_batches=_eval_function(data["eval_items"], sampler, opts),
        num_users=len(data["eval_items"]),
        num_items=data["num_items"],
        train_examples_per_epoch=train.global_size,
    )


def _parse_options(
    config: Any, global_batch_size: int, seed: int, process_index: int, process_count: int
) -> _Options:
    get = options.config_getter(config)
    local_batch = options.local_batch_size(global_batch_size, process_index, process_count)
    opts = _Options(
        name=get("name"),
        data_dir=options.data_dir(get("data_dir", None)),
        num_negatives=int(get("num_negatives")),
        num_eval_negatives=int(get("num_eval_negatives")),
        prepare=bool(get("prepare", True)),
        read_threads=int(get("read_threads", _DEFAULT_READ_THREADS)),
        local_batch=local_batch,
        seed=seed % 2**32,
        process_index=process_index,
        process_count=process_count,
    )
    if opts.num_negatives < 1 or opts.num_eval_negatives < 1:
        raise ConfigError(
            f"num_negatives={opts.num_negatives} and num_eval_negatives="
            f"{opts.num_eval_negatives} must be >= 1."
        )
    return opts


def _not_prepared_message(name: str, data_dir: str, detail: str) -> str:
    return (
        f"TFDS dataset '{name}' {detail} in data_dir={data_dir}. Prepare it with "
        f"`tfds build {name} --file_format=array_record --data_dir={data_dir}` (needs "
        "TensorFlow and internet access on the preparing machine; copy the result here)."
    )


def _open_ratings(opts: _Options) -> Sequence[bytes]:
    """The serialized records of the "train" split (MovieLens has no other)."""
    if opts.name == tiny_movielens.DATASET_NAME:
        if opts.prepare:
            tiny_movielens.prepare_tiny_movielens(opts.data_dir)
        elif not tiny_movielens.TinyMovielens(data_dir=opts.data_dir).is_prepared():
            raise DatasetNotPreparedError(
                f"Dataset '{opts.name}' is not prepared in data_dir={opts.data_dir}: set "
                "prepare=True in the data config or call "
                f"trainer.data.tiny_movielens.prepare_tiny_movielens({opts.data_dir!r})."
            )
    raw = tfds.decode.DeserializeMethod.RAW_BYTES  # Parsed below, three features only.
    try:
        # download=False: never start a download (and preparation) as a side effect.
        return tfds.data_source(
            opts.name, split="train", data_dir=opts.data_dir, download=False,
            deserialize_method=raw,
        )  # fmt: skip
    except tfds.core.DatasetNotFoundError:
        # `from None`: TFDS's message lists every dataset it knows, burying this one.
        message = _not_prepared_message(opts.name, opts.data_dir, "is not found")
        raise DatasetNotPreparedError(message) from None
    except Exception as e:
        # Diagnosed after the fact: `tfds.testing.mock_data` fakes the source, not the files.
        builder = tfds.builder(opts.name, data_dir=opts.data_dir)
        if not builder.is_prepared():
            detail = "is not prepared"
        elif tfds.core.FileFormat.ARRAY_RECORD not in builder.info.available_file_formats():
            detail = f"is prepared as {builder.info.file_format.value}, not array_record,"
        else:
            raise
        raise DatasetNotPreparedError(
            _not_prepared_message(opts.name, opts.data_dir, detail)
        ) from e


def _read_columns(source: Sequence[bytes], name: str) -> tuple[np.ndarray, ...]:
    """(user ids, movie ids, timestamps) of every record: two byte-string arrays, int64."""
    users, items, times = [], [], []
    # Batched reads are ~8x faster than one by one; plain sequences have only the latter.
    getitems = getattr(source, "__getitems__", None)
    for start in range(0, len(source), _READ_CHUNK):
        keys = range(start, min(len(source), start + _READ_CHUNK))
        records = getitems(keys) if getitems else [source[i] for i in keys]
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
    if not users:
        raise ConfigError(f"The train split of '{name}' is empty.")
    return np.concatenate(users), np.concatenate(items), np.concatenate(times)


def _codes(raw: np.ndarray) -> np.ndarray:
    """int64 codes of byte-string ids, ordered numerically if all are decimal, else as text."""
    values = raw
    try:
        numbers = raw.astype(np.int64)
        # Round trip, so that e.g. "7" and "07" stay different ids.
        if (numbers.astype(raw.dtype) == raw).all():
            values = numbers
    except ValueError:
        pass  # Not all decimal: text order.
    return np.unique(values, return_inverse=True)[1].astype(np.int64)


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
    order = np.lexsort((times, items, users))
    users, items, times = users[order], items[order], times[order]
    latest = _runs_end(users, items)  # One interaction per (user, item): the latest.
    users, items, times = users[latest], items[latest], times[latest]
    keep = np.bincount(users)[users] >= 2
    if not keep.any():
        raise ConfigError(
            f"No user of '{name}' has interacted with 2 or more distinct items: nothing to "
            "hold out for evaluation and train on."
        )
    users = np.unique(users[keep], return_inverse=True)[1].astype(np.int64)
    item_ids, items = np.unique(items[keep], return_inverse=True)
    items, times = items.astype(np.int64), times[keep]
    order = np.lexsort((items, times, users))  # Last of each user: latest, then largest id.
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


def _hash(*parts: Any) -> np.ndarray:
    """A uint64 hash of non-negative integer parts (scalars or arrays, broadcast).

    Each part is xored in and followed by the splitmix64 finaliser (a bijective avalanche).
    """
    h = np.asarray(_GOLDEN)
    with np.errstate(over="ignore"):  # Wrapping uint64 arithmetic is intended.
        for part in parts:
            h = h ^ np.asarray(part).astype(np.uint64)
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return h


def _uniform(h: np.ndarray, n: int) -> np.ndarray:
    """Maps uint64 hashes to int64 in [0, n) (n < 2**32) by multiply-shift, bias < n/2**32."""
    return (((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)).astype(np.int64)


def _permute(index: np.ndarray, size: int, key: np.ndarray) -> np.ndarray:
    """A keyed permutation of [0, size), applied to `index`; one key per element.

    A 4-round Feistel network over the smallest [0, 4**half) >= size, with cycle walking
    (re-applying it until the value falls inside [0, size)) for other sizes.
    """
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)

    def feistel(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left, right = values >> np.uint64(half), values & mask
        for round_index in range(4):
            left, right = right, left ^ (_hash(keys, round_index, right) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(index.astype(np.uint64), key)
    outside = np.flatnonzero(out >= size)
    while outside.size:  # Expected < 4 rounds: [0, 4**half) is less than 4x size.
        out[outside] = feistel(out[outside], key[outside])
        outside = outside[out[outside] >= size]
    return out.astype(np.int64)


class NegativeSampler:
    """Uniform negatives: items a user never interacted with."""

    def __init__(self, users: np.ndarray, items: np.ndarray, num_items: int) -> None:
        """Args: the int user and item ids of every interaction; the number of items."""
        self.num_items = num_items
        self._keys = np.unique(users.astype(np.int64) * num_items + items)
        self._degrees = np.bincount(users)

    def check_feasible(self, num_eval_negatives: int, name: str) -> None:
        """Raises ConfigError if some user lacks `num_eval_negatives` (>= 1) free items."""
        short = int((self.num_items - self._degrees < num_eval_negatives).sum())
        if short:
            raise ConfigError(
                f"{short} users of '{name}' have interacted with more than num_items - "
                f"num_eval_negatives = {self.num_items} - {num_eval_negatives} items, leaving "
                "too few negatives; lower num_eval_negatives."
            )

    def is_positive(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each (user, item) pair is an interaction (arrays broadcast)."""
        keys = users * self.num_items + items
        found = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return self._keys[found] == keys

    def _candidate(self, key: np.ndarray, attempt: Any) -> np.ndarray:
        return _uniform(_hash(key, attempt), self.num_items)

    def sample(self, users: np.ndarray, key: np.ndarray) -> np.ndarray:
        """One negative per user, a function of its uint64 `key` (same shape as `users`)."""
        items = self._candidate(key, 0)
        rejected = np.flatnonzero(self.is_positive(users, items))
        attempt = 1
        while rejected.size:
            items[rejected] = self._candidate(key[rejected], attempt)
            rejected = rejected[self.is_positive(users[rejected], items[rejected])]
            attempt += 1
        return items

    def sample_distinct(self, users: np.ndarray, count: int, key: np.ndarray) -> np.ndarray:
        """[len(users), count] distinct negatives per user, a function of the row's `key`.

        Row r takes the first `count` distinct non-positive candidates of attempts 0, 1, ...
        of key[r]; rows short of them retry with twice the attempts (same prefix), so the
        result does not depend on chunking. `check_feasible(count)` must hold.
        """
        out = np.empty((len(users), count), np.int64)
        todo, width = np.arange(len(users)), 2 * count + 16
        while todo.size:
            short = []
            for chunk in np.array_split(todo, math.ceil(todo.size * width / _SAMPLE_CHUNK)):
                candidates = self._candidate(key[chunk, None], np.arange(width))
                valid = ~self.is_positive(users[chunk, None], candidates)
                # Keep the first occurrence of each item: a stable sort puts it first.
                order = np.argsort(candidates, axis=1, kind="stable")
                ranked = np.take_along_axis(candidates, order, axis=1)
                first = np.ones_like(valid)
                first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
                np.put_along_axis(valid, order, np.take_along_axis(valid, order, 1) & first, 1)
                done = valid.sum(axis=1) >= count
                take = valid & (np.cumsum(valid, axis=1) <= count)
                out[chunk[done]] = candidates[done][take[done]].reshape(-1, count)
                short.append(chunk[~done])
            todo, width = np.concatenate(short), 2 * width
        return out


class _TrainBatches:
    """Training batch number `index` of this process, computed from the index alone."""

    def __init__(
        self, users: np.ndarray, items: np.ndarray, sampler: NegativeSampler, opts: _Options
    ) -> None:
        self.users, self.items, self.sampler, self.opts = users, items, sampler, opts
        self.global_size = len(users) * (1 + opts.num_negatives)
        # Rows i, i+n, ... of every epoch.
        self.local_size = len(range(opts.process_index, self.global_size, opts.process_count))
        if not self.local_size:
            raise ConfigError(
                f"'{opts.name}' has {self.global_size} training rows per epoch, none for "
                f"process {opts.process_index} of {opts.process_count}."
            )

    def __call__(self, index: int) -> Batch:
        opts = self.opts
        stream = np.arange(index * opts.local_batch, (index + 1) * opts.local_batch)
        epoch, position = np.divmod(stream, self.local_size)
        shuffle_key = _hash(opts.seed, _SHUFFLE, epoch, opts.process_index)
        local = _permute(position, self.local_size, shuffle_key)
        row = opts.process_index + local * opts.process_count  # Row of the global epoch.
        positive, slot = np.divmod(row, 1 + opts.num_negatives)
        users, items = self.users[positive], self.items[positive].copy()
        negative = np.flatnonzero(slot > 0)
        key = _hash(opts.seed, _TRAIN_NEGATIVES, epoch[negative], row[negative])
        items[negative] = self.sampler.sample(users[negative], key)
        return {
            "users": users.astype(np.int32),
            "items": items.astype(np.int32),
            "labels": (slot == 0).astype(np.float32),
            "weights": np.ones(opts.local_batch, np.float32),
        }


def _eval_function(
    eval_items: np.ndarray, sampler: NegativeSampler, opts: _Options
) -> Callable[[], Iterator[Batch]]:
    """Returns eval_batches() over this process's users, i, i+n, ..."""
    users = np.arange(opts.process_index, len(eval_items), opts.process_count)
    key = _hash(opts.seed, _EVAL_NEGATIVES, users)
    negatives = sampler.sample_distinct(users, opts.num_eval_negatives, key)
    items = np.concatenate([eval_items[users, None], negatives], axis=1).astype(np.int32)
    users = users.astype(np.int32)
    # Sized by the largest share so that every process runs the same number of
    # (collective) eval steps; smaller shares end with all-zero rows.
    largest_share = math.ceil(len(eval_items) / opts.process_count)
    num_batches = math.ceil(largest_share / opts.local_batch)
    b = opts.local_batch

    def eval_batches() -> Iterator[Batch]:
        for start in range(0, num_batches * b, b):
            rows = len(users[start : start + b])
            pad = b - rows
            yield {
                "users": np.pad(users[start : start + b], (0, pad)),
                "items": np.pad(items[start : start + b], ((0, pad), (0, 0))),
                "weights": np.pad(np.ones(rows, np.float32), (0, pad)),
            }

    return eval_batches
