"""Tests of the MovieLens record parsers: TFDS's records and the local_movielens files."""

import numpy as np
import tensorflow_datasets as tfds
from tensorflow_datasets.proto import tf_example_pb2

# Registers the MovieLens builder class, whose features serialize the records below.
from tensorflow_datasets.structured import movielens  # noqa: F401

from trainer.input import movielens as pipeline
from trainer.input import ratings
from trainer.input.builders import local_movielens

ML20M = "movielens/20m-ratings"


def test_local_movielens_records_parse_back_to_the_generated_ratings():
    columns = local_movielens.generate_ratings(num_users=300, num_ratings=30_000, seed=5)
    assert len(columns["user"]) == 30_000 and np.bincount(columns["user"]).max() > 100
    counts = np.bincount(columns["user"])[1:]
    assert (
        counts.min() >= 20 and len(np.unique(columns["user"] * 10**6 + columns["movie"])) == 30_000
    )
    rows = np.random.default_rng(0).permutation(30_000)
    records = local_movielens.serialize(columns, rows)
    users, items, times = pipeline._read_columns(records, "local")
    np.testing.assert_array_equal(users.astype(np.int64), columns["user"][rows])
    np.testing.assert_array_equal(items.astype(np.int64), columns["movie"][rows])
    np.testing.assert_array_equal(times, columns["timestamp"][rows])
    feature = tf_example_pb2.Example.FromString(records[0]).features.feature
    star = local_movielens._STARS[columns["star"][rows[0]]]
    assert feature["user_rating"].float_list.value[0] == star


def test_vectorised_parser_reads_tfds_records_like_protobuf():
    features = tfds.builder(ML20M).info.features
    rng = np.random.default_rng(3)
    examples = [
        {
            "user_id": str(int(rng.integers(1, 10**6))),
            "movie_id": str(int(rng.integers(1, 10**5))),
            "timestamp": int(rng.integers(0, 2**40)),
            "movie_title": "t" * int(rng.integers(1, 300)),
            "movie_genres": [int(rng.integers(21))],
            "user_rating": 3.5,
        }
        for _ in range(500)
    ]
    records = [features.serialize_example(example) for example in examples]
    assert max(map(len, records)) > 300  # Some lengths need two-byte varints.
    users, items, times = ratings.parse_chunk(records)
    np.testing.assert_array_equal(users, [int(e["user_id"]) for e in examples])
    np.testing.assert_array_equal(items, [int(e["movie_id"]) for e in examples])
    np.testing.assert_array_equal(times, [e["timestamp"] for e in examples])
    # Ids that are not plain decimal numbers are left to protobuf (text order).
    for odd in ("07", "a7", ""):
        record = features.serialize_example({**examples[0], "user_id": odd})
        assert ratings.parse_chunk(records[:3] + [record]) is None
