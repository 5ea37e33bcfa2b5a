"""`local_movielens`: a MovieLens-20M-sized ratings table generated locally.

Shaped like `movielens/20m-ratings` (one tf.train.Example per rating: string
"user_id" and "movie_id", int64 "timestamp", float32 "user_rating"; one "train"
split), at its scale and with its skew, so the MovieLens pipeline's start-up and
throughput can be measured here:
  * 138,493 users, each with at least 20 ratings; activity log-normal (median
    ~70, a long tail to ~9,000), scaled to 20,000,263 ratings in total;
  * 26,744 movies (ids with gaps up to 131,262) of Zipf-like popularity,
    p(rank k) ~ (k + 10)^-1.1: the top movie has ~0.5% of all ratings (0.34% in
    the real data); a user's movies are distinct, drawn by popularity;
  * timestamps from 1995 to 2015, each user active over their own span;
  * half-star ratings with the real data's histogram (4.0 and 3.0 most common).
The content is random (nothing to learn beyond popularity): the dataset measures
preparation and input throughput, not model quality.

Preparation (~1-2 minutes, ~3 GB of memory) writes the array_record files
directly: TFDS's generic writer would spend ~25 us a record serialising and
shuffling, ~10 minutes for 20M. The records are plain serialized
`tf.train.Example`s, readable by TFDS (and by the pipeline) like the real ones.
"""

import numpy as np
import tensorflow_datasets as tfds
from array_record.python import array_record_module

from trainer.input.builders import base, tiny_movielens

DATASET_NAME = "local_movielens"
NUM_USERS = 138_493
NUM_ITEMS = 26_744
NUM_RATINGS = 20_000_263
MIN_RATINGS = 20
MAX_MOVIE_ID = 131_262
SEED = 20261124
_FIRST_TIME, _LAST_TIME = 788_918_400, 1_427_846_400  # 1995-01-01 .. 2015-04-01 (UTC).
_STARS = np.arange(1, 11) / 2  # 0.5 .. 5.0
_STAR_WEIGHTS = np.array([1.1, 3.4, 3.4, 7.2, 4.4, 21.4, 14.1, 27.8, 7.7, 9.5])  # % (ML-20M)
_SHARDS = 16


def generate_ratings(num_users: int = NUM_USERS, num_ratings: int = NUM_RATINGS, seed: int = SEED):
    """The ratings as columns (vectorised; ~20 s and ~2 GB for the full size).

    Returns:
      dict of equal-length arrays: "user" (int64, 1-based user ids), "movie" (int64 movie
      ids), "timestamp" (int64), "star" (int64 index into the half stars), grouped by user.
    """
    rng = np.random.default_rng(seed)
    counts = np.maximum(rng.lognormal(np.log(70), 1.05, num_users), MIN_RATINGS)
    counts = np.minimum(counts, NUM_ITEMS // 3)
    extra = (
        (counts - MIN_RATINGS)
        * (num_ratings - MIN_RATINGS * num_users)
        / (counts - MIN_RATINGS).sum()
    )
    counts = MIN_RATINGS + np.floor(extra).astype(np.int64)
    counts[: num_ratings - counts.sum()] += 1  # Exactly num_ratings.
    popularity = (np.arange(NUM_ITEMS) + 10.0) ** -1.1
    cumulative = np.cumsum(popularity / popularity.sum())
    users = np.repeat(np.arange(num_users), counts)
    items = np.empty_like(users)
    todo = np.arange(len(users))
    while todo.size:  # Redraw the duplicates of a user's movies until all are distinct.
        items[todo] = np.searchsorted(cumulative, rng.random(todo.size) * cumulative[-1])
        keys = users * NUM_ITEMS + items
        order = np.argsort(keys, kind="stable")
        repeated = np.zeros(len(keys), bool)
        repeated[order[1:]] = keys[order[1:]] == keys[order[:-1]]
        todo = np.flatnonzero(repeated)
    # Item rank -> a movie id; ranks are shuffled over ids so popularity is not id order.
    movie_ids = np.sort(rng.choice(np.arange(1, MAX_MOVIE_ID + 1), NUM_ITEMS, replace=False))
    movies = rng.permutation(movie_ids)[items]
    start = rng.uniform(_FIRST_TIME, _LAST_TIME, num_users)
    span = np.minimum(rng.exponential(2 * 365 * 86_400, num_users), _LAST_TIME - start)
    times = (start[users] + rng.random(len(users)) * span[users]).astype(np.int64)
    stars = rng.choice(len(_STARS), len(users), p=_STAR_WEIGHTS / _STAR_WEIGHTS.sum())
    return {"user": users + 1, "movie": movies, "timestamp": times, "star": stars}


def _length_prefixed(tag: int, payload: bytes) -> bytes:
    assert len(payload) < 128  # One-byte varint lengths throughout.
    return bytes([tag, len(payload)]) + payload


def _feature_entry(key: str, feature: bytes) -> bytes:
    """A `Features.feature` map entry: {key, value}."""
    return _length_prefixed(
        0x0A, _length_prefixed(0x0A, key.encode()) + _length_prefixed(0x12, feature)
    )


def _bytes_entry(key: str, value: bytes) -> bytes:
    return _feature_entry(key, _length_prefixed(0x0A, _length_prefixed(0x0A, value)))


def serialize(columns: dict[str, np.ndarray], rows: np.ndarray) -> list[bytes]:
    """Serialized `tf.train.Example`s of `rows`, written field by field (~1 us a record)."""
    users = {
        int(u): _bytes_entry("user_id", str(int(u)).encode())
        for u in np.unique(columns["user"][rows])
    }
    movies = {
        int(m): _bytes_entry("movie_id", str(int(m)).encode())
        for m in np.unique(columns["movie"][rows])
    }
    stars = [
        _feature_entry("user_rating", _length_prefixed(0x12, _length_prefixed(0x0A, s.tobytes())))
        for s in _STARS.astype(np.float32)
    ]
    # Every timestamp is in [2**28, 2**35): a 5-byte varint, computed for all rows at once.
    times = columns["timestamp"][rows].astype(np.uint64)
    assert times.min() >= 2**28 and times.max() < 2**35
    varints = np.stack([(times >> np.uint64(7 * i)) & np.uint64(0x7F) for i in range(5)], 1)
    varints[:, :4] |= 0x80
    varints = varints.astype(np.uint8).tobytes()
    time_prefix = _feature_entry(
        "timestamp", _length_prefixed(0x1A, _length_prefixed(0x0A, b"01234"))
    )[:-5]
    heads = [bytes((0x0A, n)) for n in range(128)]  # Example.features tag and length.
    out = []
    for row, (user, movie, star) in enumerate(
        zip(
            columns["user"][rows].tolist(),
            columns["movie"][rows].tolist(),
            columns["star"][rows].tolist(),
            strict=True,
        )
    ):
        parts = (
            users[user],
            movies[movie],
            time_prefix,
            varints[5 * row : 5 * row + 5],
            stars[star],
        )
        features = b"".join(parts)
        out.append(heads[len(features)] + features)
    return out


class LocalMovielens(base.LocalBuilder):
    """MovieLens-20M-sized synthetic ratings (see the module docstring)."""

    def features(self) -> tfds.features.FeatureConnector:
        return tiny_movielens.rating_features()

    def _split_generators(self, dl_manager: tfds.download.DownloadManager) -> dict:
        raise NotImplementedError  # `_download_and_prepare` writes the files itself.

    def _generate_examples(self):
        raise NotImplementedError

    def _download_and_prepare(self, dl_manager, download_config) -> None:
        del dl_manager, download_config  # Nothing to download.
        columns = generate_ratings()
        # Records in random order, like TFDS's shuffled files.
        order = np.random.default_rng(SEED + 1).permutation(len(columns["user"]))
        template = self._get_filename_template(split_name="train")
        lengths, num_bytes = [], 0
        for path, rows in zip(
            template.sharded_filepaths(_SHARDS), np.array_split(order, _SHARDS), strict=True
        ):
            writer = array_record_module.ArrayRecordWriter(str(path), "group_size:1")
            for record in serialize(columns, rows):
                writer.write(record)
                num_bytes += len(record)
            writer.close()
            lengths.append(len(rows))
        split = tfds.core.SplitInfo(
            name="train", shard_lengths=lengths, num_bytes=num_bytes, filename_template=template
        )
        self.info.set_splits(tfds.core.SplitDict([split]))
