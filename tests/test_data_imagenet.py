"""Tests of the image classification input pipeline (tiny_images, mocked imagenet2012)."""

import hashlib

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds

# Registers the ImageNet builder class, which `tfds.testing.mock_data` needs to fake the
# dataset from code (real runs read prepared files without it).
from tensorflow_datasets.image_classification import imagenet  # noqa: F401

from trainer.data import imagenet as pipeline
from trainer.data import tiny_images
from trainer.data.imagenet import (
    EVAL_KEYS,
    TRAIN_KEYS,
    DatasetNotPreparedError,
    make_image_data,
)
from trainer.errors import ConfigError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared tiny_images for the whole module (preparation takes ~2 s)."""
    path = tmp_path_factory.mktemp("tfds")
    tiny_images.prepare_tiny_images(str(path))
    return path


def _config(data_dir, **overrides) -> ml_collections.ConfigDict:
    config = {"name": "tiny_images", "data_dir": str(data_dir), "image_size": 32}
    config.update(overrides)
    return ml_collections.ConfigDict(config)


def _make(config, global_batch_size=50, seed=0, process_index=0, process_count=1):
    return make_image_data(
        config,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


def test_tiny_images_splits_and_determinism(data_dir):
    train = tfds.data_source("tiny_images", split="train", data_dir=str(data_dir))
    validation = tfds.data_source("tiny_images", split="validation", data_dir=str(data_dir))
    assert (len(train), len(validation)) == (5000, 500)
    example = train[0]
    assert example["image"].shape == (32, 32, 3) and example["image"].dtype == np.uint8
    images, labels = tiny_images.generate_images("validation")
    again_images, again_labels = tiny_images.generate_images("validation")
    np.testing.assert_array_equal(images, again_images)
    np.testing.assert_array_equal(labels, again_labels)
    assert np.bincount(labels).tolist() == [50] * 10
    # The stored split holds the generated images (TFDS reorders the records).
    stored = {validation[i]["image"].tobytes(): int(validation[i]["label"]) for i in range(500)}
    assert stored == {
        image.tobytes(): int(label) for image, label in zip(images, labels, strict=True)
    }


def test_tiny_images_are_learnable():
    """A nearest-class-mean classifier on raw pixels beats 50% (chance: 10%)."""
    train_images, train_labels = tiny_images.generate_images("train")
    images, labels = tiny_images.generate_images("validation")
    flat = train_images.reshape(len(train_images), -1).astype(np.float32)
    means = np.stack([flat[train_labels == c].mean(0) for c in range(10)])
    queries = images.reshape(len(images), -1).astype(np.float32)
    distances = ((queries[:, None, :] - means[None]) ** 2).sum(-1)
    assert (distances.argmin(1) == labels).mean() > 0.5


def test_train_batches(data_dir):
    data = _make(_config(data_dir))
    assert data.num_classes == 10
    for batch in _take(data.train, 3):
        assert set(batch) == set(TRAIN_KEYS)
        assert batch["images"].shape == (50, 32, 32, 3) and batch["images"].dtype == np.uint8
        assert batch["labels"].shape == (50,) and batch["labels"].dtype == np.int32
        assert batch["labels"].min() >= 0 and batch["labels"].max() < 10


def test_random_crop_box_and_resize():
    rng = np.random.default_rng(0)
    for height, width in [(100, 300), (300, 100), (64, 64), (5, 200)]:
        for _ in range(20):
            top, left, h, w = pipeline.random_crop_box(height, width, rng, 0.08)
            assert top >= 0 and left >= 0 and top + h <= height and left + w <= width
            assert h > 0 and w > 0
    # Far outside the aspect bounds: the 10 tries fail, then the center crop.
    assert pipeline.random_crop_box(5, 200, np.random.default_rng(1), 0.08) == (0, 96, 5, 7)
    image = np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    out = pipeline.crop_and_resize(image, (3, 5, 20, 30), 16)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8
    box = pipeline.center_crop_box(256, 320, 224 / 256)
    assert box == (16, 48, 224, 224)
    np.testing.assert_array_equal(
        pipeline.crop_and_resize(image, (0, 0, 40, 40), 40), image[:, :40]
    )


def _rows(data, count):
    """(labels, image hashes) of the next `count` training rows."""
    labels, hashes = [], []
    while len(labels) < count:
        batch = next(data.train)
        labels.extend(batch["labels"].tolist())
        hashes.extend(hashlib.sha1(image.tobytes()).hexdigest() for image in batch["images"])
    return labels[:count], hashes[:count]


def test_augmentation_is_keyed_by_seed_epoch_and_index(data_dir):
    config = _config(data_dir, read_threads=1)
    data = _make(config, global_batch_size=500)  # 10 batches an epoch.
    first = _take(data.train, 10)
    second = _take(data.train, 10)
    # Same examples in a new order, with new crops and flips.
    epoch1 = {image.tobytes() for batch in first for image in batch["images"]}
    epoch2 = {image.tobytes() for batch in second for image in batch["images"]}
    assert sorted(np.concatenate([b["labels"] for b in first]).tolist()) == sorted(
        np.concatenate([b["labels"] for b in second]).tolist()
    )
    assert len(epoch1 & epoch2) < 50
    # Another run (and read threading) with the same seed: identical batches.
    again = _take(_make(_config(data_dir, read_threads=2), global_batch_size=500).train, 10)
    for a, b in zip(first, again, strict=True):
        np.testing.assert_array_equal(a["images"], b["images"])
        np.testing.assert_array_equal(a["labels"], b["labels"])
    other = next(_make(config, global_batch_size=500, seed=1).train)
    assert not np.array_equal(other["images"], first[0]["images"])


def test_eval_is_deterministic_identity_for_tiny(data_dir):
    data = _make(_config(data_dir, num_eval_examples=120))
    batches = list(data.eval_batches())
    again = list(data.eval_batches())
    assert len(batches) == 3  # 120 rows in batches of 50: the last has 20 real rows.
    for a, b in zip(batches, again, strict=True):
        assert set(a) == set(EVAL_KEYS)
        for key in EVAL_KEYS:
            np.testing.assert_array_equal(a[key], b[key])
    weights = np.concatenate([b["weights"] for b in batches])
    assert weights.dtype == np.float32 and weights.sum() == 120 and weights[:120].all()
    validation = tfds.data_source("tiny_images", split="validation", data_dir=str(data_dir))
    np.testing.assert_array_equal(batches[0]["images"][7], validation[7]["image"])
    assert batches[0]["labels"][7] == validation[7]["label"]
    assert not batches[2]["images"][20:].any() and not batches[2]["labels"][20:].any()


def test_process_shares_partition_an_epoch(data_dir):
    single = _rows(_make(_config(data_dir), global_batch_size=500), 5000)
    shares = [
        _rows(
            _make(_config(data_dir), global_batch_size=500, process_index=i, process_count=2), 2500
        )
        for i in range(2)
    ]
    pairs = [set(zip(*share, strict=True)) for share in shares]
    assert not pairs[0] & pairs[1]
    assert pairs[0] | pairs[1] == set(zip(*single, strict=True))


def test_resume_from_state(data_dir):
    data = _make(_config(data_dir))
    _take(data.train, 3)
    state = data.train.get_state()
    expected = _take(data.train, 2)
    resumed = _make(_config(data_dir))
    resumed.train.set_state(state)
    for a, b in zip(expected, _take(resumed.train, 2), strict=True):
        np.testing.assert_array_equal(a["images"], b["images"])
        np.testing.assert_array_equal(a["labels"], b["labels"])


def test_eval_padding_aligns_processes(data_dir):
    config = _config(data_dir, num_eval_examples=101)
    per_process = [
        list(_make(config, global_batch_size=40, process_index=i, process_count=4).eval_batches())
        for i in range(4)
    ]
    # Shares of 26, 25, 25, 25 rows in local batches of 10: 3 batches everywhere.
    assert [len(batches) for batches in per_process] == [3] * 4
    counts = [int(sum(b["weights"].sum() for b in batches)) for batches in per_process]
    assert counts == [26, 25, 25, 25]
    assert all(b["images"].shape == (10, 32, 32, 3) for bs in per_process for b in bs)


def test_imagenet_on_mock_data(tmp_path):
    config = _config(tmp_path, name="imagenet2012", image_size=64, num_eval_examples=10)
    with tfds.testing.mock_data(num_examples=12, policy=tfds.testing.MockPolicy.USE_CODE):
        data = _make(config, global_batch_size=8, process_index=1, process_count=2)
        train = _take(data.train, 4)  # Past an epoch of the 6-example share.
        batches = list(data.eval_batches())
    assert data.num_classes == 1000
    for batch in train:
        assert batch["images"].shape == (4, 64, 64, 3) and batch["images"].dtype == np.uint8
        assert batch["labels"].dtype == np.int32 and batch["labels"].max() < 1000
    assert len(batches) == 2 and all(b["images"].shape == (4, 64, 64, 3) for b in batches)
    assert [b["weights"].tolist() for b in batches] == [[1, 1, 1, 1], [1, 0, 0, 0]]


def test_missing_imagenet_names_the_build_command(tmp_path):
    with pytest.raises(DatasetNotPreparedError) as error:
        _make(_config(tmp_path, name="imagenet2012"))
    message = str(error.value)
    assert "imagenet2012" in message and "downloads/manual" in message
    assert f"tfds build imagenet2012 --file_format=array_record --data_dir={tmp_path}" in message


def test_tiny_images_not_prepared_and_bad_config(tmp_path):
    with pytest.raises(DatasetNotPreparedError, match="prepare_tiny_images"):
        _make(_config(tmp_path, prepare=False))
    with pytest.raises(ConfigError, match="Unknown image dataset"):
        _make(_config(tmp_path, name="cifar10"))
    with pytest.raises(ConfigError, match="multiple"):
        _make(_config(tmp_path), global_batch_size=7, process_count=2)
