"""`tiny_movielens`: a local, synthetic implicit-feedback TFDS dataset.

The ratings are generated from code (no download), deterministically from a
fixed seed, and shaped like `movielens/20m-ratings`: one record per rating with
string "user_id" and "movie_id" (decimal ids, movie ids with gaps), an int64
"timestamp" and a float32 half-star "user_rating", in a single "train" split.
So the same input pipeline serves both.

The generating model is low-rank, so a recommender can learn it:
  * every user and item has a rank-`RANK` factor vector, and every item a
    popularity bias; a user's preference for an item is their dot product
    (scaled to unit variance) plus the bias, times `SHARPNESS`;
  * each user interacts with 20..60 distinct items, drawn without replacement
    with probability proportional to exp(preference) (Gumbel top-k), so users
    concentrate on a few dozen of the 500 items;
  * the interactions happen in random order at non-decreasing timestamps; some
    fall on the same timestamp, as in the real data, so "latest" needs a
    tie-break;
  * the rating grows with the preference (it is not needed for implicit
    feedback but keeps the features of the real dataset).

Preparation writes array_record files with TFDS's own writer, without
TensorFlow (see `tiny_translation`, which uses the same technique).
"""

from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from trainer.input.builders import base

DATASET_NAME = "tiny_movielens"
NUM_USERS = 1000
NUM_ITEMS = 500
RANK = 8
MIN_INTERACTIONS = 20
MAX_INTERACTIONS = 60
# Preference scale: with unit-variance dot products, exp(2.5 * x) puts most of a
# user's probability mass on a few dozen items.
SHARPNESS = 2.5
SEED = 20240614
# Raw movie ids are drawn from [1, _MOVIE_ID_RANGE): gaps, like the real ids.
_MOVIE_ID_RANGE = 5 * NUM_ITEMS
_FIRST_TIMESTAMP = 1_000_000_000
_DAY = 86_400


def preference_scores(seed: int = SEED) -> np.ndarray:
    """The generating model's preference of every user for every item.

    Args:
      seed: Seed of the factors; the dataset uses `SEED`.

    Returns:
      float64 [NUM_USERS, NUM_ITEMS] logits, indexed by dense ids (user `u` is
      raw user id `u + 1`; item `i` is the `i`-th smallest raw movie id).
    """
    rng = np.random.default_rng((seed, 0))
    users = rng.normal(size=(NUM_USERS, RANK))
    items = rng.normal(size=(NUM_ITEMS, RANK))
    popularity = rng.normal(scale=0.5, size=NUM_ITEMS)
    return SHARPNESS * (users @ items.T / np.sqrt(RANK) + popularity)


def generate_ratings(seed: int = SEED) -> dict[str, np.ndarray]:
    """Generates every rating deterministically, grouped by user.

    Args:
      seed: Seed of the factors and of the sampling; the dataset uses `SEED`.

    Returns:
      Columns of equal length: "user_id" and "movie_id" (str), "timestamp"
      (int64) and "user_rating" (float32).
    """
    scores = preference_scores(seed)
    rng = np.random.default_rng((seed, 1))
    movie_ids = np.sort(rng.choice(np.arange(1, _MOVIE_ID_RANGE), NUM_ITEMS, replace=False))
    columns: dict[str, list[np.ndarray]] = {k: [] for k in ("user", "item", "time", "rating")}
    for user in range(NUM_USERS):
        count = int(rng.integers(MIN_INTERACTIONS, MAX_INTERACTIONS + 1))
        # Gumbel top-k: `count` distinct items with softmax(scores) sampling.
        keys = scores[user] + rng.gumbel(size=NUM_ITEMS)
        items = rng.permutation(np.argpartition(-keys, count)[:count])
        # Gaps of up to 3 days; 15% are 0, so some interactions share a timestamp.
        gaps = np.where(rng.random(count) < 0.15, 0, rng.integers(1, 3 * _DAY, size=count))
        times = _FIRST_TIMESTAMP + int(rng.integers(0, 1000 * _DAY)) + np.cumsum(gaps)
        ratings = np.clip(np.round(2 * (3 + scores[user, items] / SHARPNESS)) / 2, 0.5, 5)
        columns["user"].append(np.full(count, user))
        columns["item"].append(items)
        columns["time"].append(times)
        columns["rating"].append(ratings)
    users, items, times, ratings = (np.concatenate(columns[k]) for k in columns)
    return {
        "user_id": (users + 1).astype(str),
        "movie_id": movie_ids[items].astype(str),
        "timestamp": times.astype(np.int64),
        "user_rating": ratings.astype(np.float32),
    }


def rating_features() -> tfds.features.FeatureConnector:
    """The features of movielens/20m-ratings that the embedded MovieLens datasets keep."""
    return tfds.features.FeaturesDict(
        {"user_id": np.str_, "movie_id": np.str_, "timestamp": np.int64, "user_rating": np.float32}
    )


class TinyMovielens(base.LocalBuilder):
    """Synthetic low-rank implicit feedback shaped like movielens/20m-ratings."""

    def features(self) -> tfds.features.FeatureConnector:
        return rating_features()

    SPLITS = ("train",)

    def _generate_examples(self, split: str) -> Iterator:
        del split  # The only one.
        columns = generate_ratings()
        for index in range(len(columns["user_id"])):
            yield index, {key: values[index] for key, values in columns.items()}


def prepare_tiny_movielens(data_dir: str) -> None:
    """Builds `tiny_movielens` under `data_dir` if missing (see `prepare_locally`)."""
    base.prepare_locally(TinyMovielens, data_dir)
