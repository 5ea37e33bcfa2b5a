"""Tests of the MovieLens input pipeline (tiny_movielens, mocked movielens/20m-ratings)."""

import collections
import importlib.util
import json
import os
import sys

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import data_section, open_pipeline

# Registers the MovieLens builder class, which `tfds.testing.mock_data` needs to fake the
# dataset from code (real runs read prepared files without it).
from tensorflow_datasets.structured import movielens  # noqa: F401

from trainer.errors import ConfigError, UserError
from trainer.input import feed
from trainer.input import movielens as pipeline
from trainer.input.builders import tiny_movielens
from trainer.input.movielens import EVAL_KEYS, TRAIN_KEYS, make_movielens_data
from trainer.input.source import DatasetNotPreparedError

ML20M = "movielens/20m-ratings"


def _config(data_dir, **overrides) -> ml_collections.ConfigDict:
    return data_section(
        "tiny_movielens",
        data_dir,
        **{
            "num_negatives": 4,
            "num_eval_negatives": 99,
            **overrides,
        },
    )


def _make(config, global_batch_size=256, **where):
    return open_pipeline(make_movielens_data, config, global_batch_size, **where)


def _rows(iterator, count):
    """The next `count` training rows of `iterator`, as one dict of arrays."""
    batches, total = [], 0
    while total < count:
        batches.append(next(iterator))
        total += len(batches[-1]["labels"])
    return {key: np.concatenate([b[key] for b in batches])[:count] for key in TRAIN_KEYS}


def _positive_pairs(rows):
    """The set of (user, item) of the rows labelled 1."""
    positive = rows["labels"] == 1
    return set(zip(rows["users"][positive].tolist(), rows["items"][positive].tolist(), strict=True))


def _codes(rows):
    """One int64 per row (user, item, label), sorted: comparable as multisets."""
    return np.sort(rows["users"] * 2000 + rows["items"] * 2 + rows["labels"].astype(np.int64))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    data_dir = tmp_path_factory.mktemp("tfds")
    tiny_movielens.prepare_tiny_movielens(str(data_dir))
    return data_dir


@pytest.fixture(scope="session")
def reference():
    """Leave-one-out of tiny_movielens computed plainly from the generator's columns."""
    columns = tiny_movielens.generate_ratings()
    raw_users = columns["user_id"].astype(int)
    raw_items = columns["movie_id"].astype(int)
    user_ids = {u: i for i, u in enumerate(sorted(set(raw_users)))}
    item_ids = {m: i for i, m in enumerate(sorted(set(raw_items)))}
    history = collections.defaultdict(list)
    for user, item, time in zip(raw_users, raw_items, columns["timestamp"], strict=True):
        history[user_ids[user]].append((int(time), item_ids[item]))
    users = range(len(user_ids))
    latest = np.array([max(history[u])[1] for u in users])  # Ties: the larger item id.
    positives = [{item for _, item in history[u]} for u in users]
    train = {(u, i) for u in users for i in positives[u] if i != latest[u]}
    liked = np.zeros((len(user_ids), len(item_ids)), bool)
    for u in users:
        liked[u, list(positives[u])] = True
    ties = sum(sorted(history[u])[-1][0] == sorted(history[u])[-2][0] for u in users)
    return {"latest": latest, "train": train, "liked": liked, "ties": ties}


def test_tiny_dataset_is_prepared_without_tensorflow(tiny_dir):
    assert importlib.util.find_spec("tensorflow") is None
    assert "tensorflow" not in sys.modules
    source = tfds.data_source("tiny_movielens", split="train", data_dir=str(tiny_dir))
    columns = tiny_movielens.generate_ratings()
    assert len(source) == len(columns["user_id"]) > 1000 * 20
    assert set(source[0]) == {"user_id", "movie_id", "timestamp", "user_rating"}
    stored = {(ex["user_id"], ex["movie_id"], int(ex["timestamp"])) for ex in source}
    generated = zip(columns["user_id"], columns["movie_id"], columns["timestamp"], strict=True)
    assert stored == {(u.encode(), m.encode(), int(t)) for u, m, t in generated}
    version_dir = tiny_dir / "tiny_movielens" / "1.0.0"
    info_mtime = (version_dir / "dataset_info.json").stat().st_mtime_ns
    tiny_movielens.prepare_tiny_movielens(str(tiny_dir))  # Idempotent: a no-op.
    assert (version_dir / "dataset_info.json").stat().st_mtime_ns == info_mtime
    assert not [p for p in os.listdir(tiny_dir) if p.startswith(".tiny_movielens-")]


def test_tiny_data_is_learnable(tiny_dir, reference):
    data = _make(_config(tiny_dir), global_batch_size=500)
    assert (data.num_users, data.num_items) == (1000, 500)
    assert reference["ties"] > 10  # The tie-break of "latest" matters.
    # The generating model ranks the held-out positive among 99 negatives far better
    # than chance (HR@10 = 0.1): there is something to learn.
    scores, hits = tiny_movielens.preference_scores(), 0
    for batch in data.eval_batches():
        s = scores[batch["users"][:, None], batch["items"]]
        hits += (((s[:, 1:] >= s[:, :1]).sum(axis=1) < 10) * batch["weights"]).sum()
    assert hits / 1000 > 0.6


def test_leave_one_out_and_one_epoch_of_training_rows(tiny_dir, reference):
    data = _make(_config(tiny_dir), global_batch_size=4096)
    evaluated = np.concatenate([b["items"][:, 0] for b in data.eval_batches()])[:1000]
    np.testing.assert_array_equal(evaluated, reference["latest"])
    num_positives = len(reference["train"])
    assert data.train_examples_per_epoch == 5 * num_positives
    epoch = data.train_examples_per_epoch
    both = _rows(data.train, 2 * epoch)  # Batches straddle the epoch boundary.
    epochs = [{k: v[i * epoch : (i + 1) * epoch] for k, v in both.items()} for i in range(2)]
    for rows in epochs:
        assert {k: v.dtype for k, v in rows.items()} == {
            "users": np.int32,
            "items": np.int32,
            "labels": np.float32,
            "weights": np.float32,
        }
        assert (rows["weights"] == 1).all()
        positive = rows["labels"] == 1
        assert positive.sum() == num_positives  # Exactly 1:4.
        # Every training positive once; no eval positive.
        assert _positive_pairs(rows) == reference["train"]
        # Four negatives per positive, for the positive's user.
        np.testing.assert_array_equal(
            np.bincount(rows["users"][~positive], minlength=1000),
            4 * np.bincount(rows["users"][positive], minlength=1000),
        )
    assert not np.array_equal(epochs[0]["users"][:100], epochs[1]["users"][:100])  # Reshuffled.
    assert not np.array_equal(_codes(epochs[0]), _codes(epochs[1]))  # New negatives.


def test_negatives_are_uniform_over_items_never_interacted(tiny_dir, reference):
    data = _make(_config(tiny_dir), global_batch_size=4096)
    rows = _rows(data.train, data.train_examples_per_epoch)
    negative = rows["labels"] == 0
    users, items = rows["users"][negative], rows["items"][negative]
    assert len(items) > 150_000
    assert not reference["liked"][users, items].any()
    # Expected count of item j: sum over negatives of 1 / (free items of the user) if j is
    # free for that user.
    liked = reference["liked"]
    free = (~liked) / (~liked).sum(axis=1, keepdims=True)
    expected = (np.bincount(users, minlength=1000)[:, None] * free).sum(axis=0)
    observed = np.bincount(items, minlength=500)
    assert (np.abs(observed - expected) < 5 * np.sqrt(expected) + 1).all()
    for batch in data.eval_batches():
        real = batch["weights"] > 0
        negatives = batch["items"][real, 1:]
        assert not reference["liked"][batch["users"][real, None], negatives].any()
        assert all(len(set(row)) == 99 for row in negatives.tolist())  # Distinct per user.


def test_pipeline_is_deterministic(tiny_dir):
    first, again, other = (_make(_config(tiny_dir), seed=s) for s in (5, 5, 6))
    batches = [next(first.train) for _ in range(3)]
    for want in batches:
        got = next(again.train)
        for key in TRAIN_KEYS:
            np.testing.assert_array_equal(want[key], got[key])
    assert not np.array_equal(next(other.train)["items"], batches[0]["items"])
    evals = [next(iter(d.eval_batches()))["items"] for d in (first, again, other)]
    np.testing.assert_array_equal(evals[0], evals[1])
    np.testing.assert_array_equal(evals[0][:, 0], evals[2][:, 0])  # Same held-out positives,
    assert not np.array_equal(evals[0][:, 1:], evals[2][:, 1:])  # other negatives.


def test_processes_take_blocks_of_one_global_order(tiny_dir):
    config = _config(tiny_dir)
    single = _make(config, global_batch_size=512).train
    shares = [
        _make(config, global_batch_size=512, process_index=i, process_count=4).train
        for i in range(4)
    ]
    for _ in range(3):
        want, got = next(single), [next(share) for share in shares]
        for key in TRAIN_KEYS:
            np.testing.assert_array_equal(want[key], np.concatenate([g[key] for g in got]))


def test_train_iterator_resumes_from_saved_state(tiny_dir):
    config = _config(tiny_dir)
    data = _make(config, seed=3, global_batch_size=64, process_index=1, process_count=2)
    assert isinstance(data.train, feed.TrainBatches)
    first = next(data.train)
    assert {k: v.shape for k, v in first.items()} == {k: (32,) for k in TRAIN_KEYS}
    for _ in range(3):
        next(data.train)
    state = data.train.get_state()
    assert json.loads(json.dumps(state)) == {"global_batch": 4}
    expected = [next(data.train) for _ in range(2)]
    # The position is global: a single process resumes with the whole global batches.
    restored = _make(config, seed=3, global_batch_size=64)
    restored.train.set_state(state)
    for want in expected:
        got = next(restored.train)
        for key in TRAIN_KEYS:
            np.testing.assert_array_equal(want[key], got[key][32:])


def test_worker_processes_give_the_same_batches(tiny_dir):
    expected = _rows(_make(_config(tiny_dir), seed=1).train, 256 * 4)
    workers = _make(_config(tiny_dir, worker_count=2), seed=1).train
    try:
        got = _rows(workers, 256 * 4)
    finally:
        workers.close()
    for key in TRAIN_KEYS:
        np.testing.assert_array_equal(expected[key], got[key])


def test_eval_batches_are_aligned_across_processes(tiny_dir, reference):
    whole = np.concatenate([b["items"] for b in _make(_config(tiny_dir)).eval_batches()])
    for index in range(3):
        data = _make(_config(tiny_dir), global_batch_size=96, process_index=index, process_count=3)
        batches = list(data.eval_batches())
        # 334 / 333 / 333 users, 32 a batch: every process runs ceil(334 / 32) = 11 batches.
        assert len(batches) == 11
        rows = {key: np.concatenate([b[key] for b in batches]) for key in EVAL_KEYS}
        assert rows["items"].shape == (352, 100) and rows["items"].dtype == np.int32
        assert rows["users"].dtype == np.int32 and rows["weights"].dtype == np.float32
        users = np.arange(index, 1000, 3)
        count = len(users)
        np.testing.assert_array_equal(rows["users"][:count], users)
        assert (rows["weights"][:count] == 1).all()
        for key in EVAL_KEYS:
            assert not rows[key][count:].any()  # Padding rows are all zero.
        np.testing.assert_array_equal(rows["items"][:count, 0], reference["latest"][users])
        # A user's eval negatives do not depend on the process count.
        np.testing.assert_array_equal(rows["items"][:count], whole[users])
        again = next(iter(data.eval_batches()))  # A fresh iterable each call.
        np.testing.assert_array_equal(again["items"], batches[0]["items"])


def _mock_ratings(features):
    """Serialized 20m-ratings records with random text ids, duplicates and tied timestamps."""
    rng = np.random.default_rng(0)
    letters = list("abcdefghij")
    users = ["".join(rng.choice(letters, 12)) for _ in range(30)]
    movies = ["".join(rng.choice(letters, 12)) for _ in range(80)]
    ratings = [
        (users[rng.integers(30)], movies[rng.integers(80)], int(rng.integers(40)))
        for _ in range(600)
    ]
    ratings.append(("single_user", "only_rated_by_single_user", 5))  # Both are dropped.
    examples = [
        {
            "user_id": u,
            "movie_id": m,
            "timestamp": t,
            "movie_title": "a title",
            "movie_genres": [int(rng.integers(21))],
            "user_rating": 3.5,
        }
        for u, m, t in ratings
    ]
    return [features.serialize_example(ex) for ex in examples], ratings


def test_movielens_20m_pipeline_on_mock_data(tmp_path):
    def as_data_source(builder, split, decoders=None, deserialize_method=None):
        assert (builder.name, split, decoders) == ("movielens", "train", None)
        assert deserialize_method == tfds.decode.DeserializeMethod.RAW_BYTES
        return records

    records, ratings = _mock_ratings(tfds.builder(ML20M).info.features)
    config = _config(tmp_path, name=ML20M, num_eval_negatives=20)
    policy = tfds.testing.MockPolicy.USE_CODE
    with tfds.testing.mock_data(policy=policy, as_data_source_fn=as_data_source):
        data = _make(config, global_batch_size=16, process_index=1, process_count=2)
    # Reference: the latest (timestamp, item) per user among distinct pairs, text-sorted ids.
    latest = {}
    for user, movie, time in ratings:
        latest[user, movie] = max(latest.get((user, movie), -1), time)
    per_user = collections.Counter(user for user, _ in latest)
    kept = {pair: t for pair, t in latest.items() if per_user[pair[0]] >= 2}
    user_ids = {u: i for i, u in enumerate(sorted({u for u, _ in kept}))}
    item_ids = {m: i for i, m in enumerate(sorted({m for _, m in kept}))}
    assert (data.num_users, data.num_items) == (len(user_ids), len(item_ids))
    assert len(user_ids) == 30 and 70 < len(item_ids) <= 80  # The single user's item is gone.
    assert len(kept) < 600  # Repeated pairs were merged.
    assert data.train_examples_per_epoch == 5 * (len(kept) - 30)
    held_out = {}
    for (user, movie), time in kept.items():
        u, key = user_ids[user], (time, item_ids[movie])
        held_out[u] = max(held_out.get(u, key), key)
    positives = {(user_ids[u], item_ids[m]) for u, m in kept}
    for _ in range(5):
        batch = next(data.train)
        assert {k: (v.shape, v.dtype.name) for k, v in batch.items()} == {
            "users": ((8,), "int32"),
            "items": ((8,), "int32"),
            "labels": ((8,), "float32"),
            "weights": ((8,), "float32"),
        }
        for u, i, label in zip(batch["users"], batch["items"], batch["labels"], strict=True):
            assert ((int(u), int(i)) in positives) == (label == 1)
    batches = list(data.eval_batches())
    assert len(batches) == 2  # 15 users for each of the 2 processes, 8 a batch.
    for batch in batches:
        assert batch["items"].shape == (8, 21)
        for u, row, weight in zip(batch["users"], batch["items"], batch["weights"], strict=True):
            if weight:
                assert int(row[0]) == held_out[int(u)][1] and int(u) % 2 == 1
                assert not {(int(u), int(i)) for i in row[1:]} & positives


@pytest.mark.parametrize("name", [ML20M, "made_up_movielens/ratings"])
def test_missing_tfds_dataset_raises_a_clear_error(tmp_path, name):
    with pytest.raises(DatasetNotPreparedError) as error:
        _make(_config(tmp_path, name=name))
    message = str(error.value)
    assert isinstance(error.value, UserError) and "\n" not in message
    assert f"'{name}'" in message and str(tmp_path) in message
    assert f"tfds build {name} --file_format=array_record --data_dir={tmp_path}" in message


def test_bad_configs_fail_early(tiny_dir):
    with pytest.raises(ConfigError, match="multiple"):
        _make(_config(tiny_dir), global_batch_size=9, process_count=2)
    config = _config(tiny_dir)
    del config["num_negatives"]
    with pytest.raises(ConfigError, match="num_negatives"):
        _make(config)
    with pytest.raises(ConfigError, match="num_negatives=0"):
        _make(_config(tiny_dir, num_negatives=0))
    # Users with 60 interactions leave only 440 of the 500 items as negatives.
    with pytest.raises(ConfigError, match="lower num_eval_negatives"):
        _make(_config(tiny_dir, num_eval_negatives=450))


@pytest.mark.parametrize("split", ["train", "train[10%:30%]"])
def test_shard_ranges_read_the_records_of_the_split(tiny_dir, split):
    raw = tfds.decode.DeserializeMethod.RAW_BYTES
    source = tfds.data_source(
        "tiny_movielens", split=split, data_dir=str(tiny_dir), deserialize_method=raw
    )
    chunks = list(pipeline.record_chunks(source))
    assert [record for chunk in chunks for record in chunk] == [
        source[i] for i in range(len(source))
    ]
