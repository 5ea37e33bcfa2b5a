"""Tests of the image classification input pipeline (tiny_images, mocked imagenet2012)."""

import hashlib
import io

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import data_section, open_pipeline
from PIL import Image

# Registers the ImageNet builder class, which `tfds.testing.mock_data` needs to fake the
# dataset from code (real runs read prepared files without it).
from tensorflow_datasets.image_classification import imagenet  # noqa: F401

from trainer.errors import ConfigError
from trainer.input import augment
from trainer.input.builders import local_jpeg, tiny_images
from trainer.input.imagenet import EVAL_KEYS, TRAIN_KEYS, make_image_data
from trainer.input.source import DatasetNotPreparedError


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """One prepared tiny_images for the whole module (preparation takes ~2 s)."""
    path = tmp_path_factory.mktemp("tfds")
    tiny_images.prepare_tiny_images(str(path))
    return path


def _config(data_dir, **overrides) -> ml_collections.ConfigDict:
    return data_section(
        "tiny_images",
        data_dir,
        **{
            "image_size": 32,
            "eval_split": "validation",
            "num_eval_examples": -1,
            **overrides,
        },
    )


def _make(config, global_batch_size=50, **where):
    return open_pipeline(make_image_data, config, global_batch_size, **where)


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
            top, left, h, w = augment.random_crop_box(height, width, rng, 0.08)
            assert top >= 0 and left >= 0 and top + h <= height and left + w <= width
            assert h > 0 and w > 0
    # Far outside the aspect bounds: the 10 tries fail, then the center crop.
    assert augment.random_crop_box(5, 200, np.random.default_rng(1), 0.08) == (0, 96, 5, 7)
    image = np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)
    out = augment.crop_to(image, lambda h, w: (3, 5, 20, 30), 16)
    assert out.shape == (16, 16, 3) and out.dtype == np.uint8
    box = augment.center_crop_box(256, 320, 224 / 256)
    assert box == (16, 48, 224, 224)
    np.testing.assert_array_equal(
        augment.crop_to(image, lambda h, w: (0, 0, 40, 40), 40), image[:, :40]
    )
    grey = augment.crop_to(image[..., :1], lambda h, w: (0, 0, 40, 40), 8)
    assert grey.shape == (8, 8, 3) and (grey[..., 0] == grey[..., 2]).all()


def _jpeg(pixels, quality=95):
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=quality)
    return encoded.getvalue()


def test_jpeg_crops_decode_at_reduced_size_when_the_crop_allows():
    rng = np.random.default_rng(0)
    pixels = local_jpeg.generate_image(rng, 480, 640)
    data = _jpeg(pixels)
    # A 460 x 600 crop to 224: decoding at 1/2 scale still leaves >= 224 pixels.
    decoded, box = augment.decode_for_box(augment.open_image(data), (10, 20, 460, 600), 224)
    assert decoded.size == (320, 240) and box == (10.0, 5.0, 310.0, 235.0)
    # A 200 x 200 crop needs every pixel: full-size decode.
    decoded, box = augment.decode_for_box(augment.open_image(data), (0, 0, 200, 200), 224)
    assert decoded.size == (640, 480) and box == (0.0, 0.0, 200.0, 200.0)
    # Against an independent reference (full decode, crop, area-averaging resize): the
    # reduced-size decode is about as close as resampling the full decode, and without
    # reduction the path is exactly the full decode's single bilinear resample.
    full = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    for (top, left, h, w), reduced in [((10, 20, 460, 600), True), ((100, 50, 200, 300), False)]:
        got = augment.crop_to(data, lambda height, width, b=(top, left, h, w): b, 224)
        box = (left, top, left + w, top + h)
        whole = Image.fromarray(full)
        reference = np.asarray(whole.resize((224, 224), Image.Resampling.BOX, box=box), float)
        resampled = np.asarray(whole.resize((224, 224), Image.Resampling.BILINEAR, box=box))
        error = np.abs(got - reference).mean()
        baseline = np.abs(resampled - reference).mean()
        assert got.shape == (224, 224, 3) and error < baseline + 1.0, (error, baseline)
        assert reduced or np.array_equal(got, resampled)


def test_local_jpeg_images_are_imagenet_like():
    sizes, areas, detail = [], [], []
    for index in range(12):
        data = local_jpeg.generate_jpeg("train", index)
        assert data == local_jpeg.generate_jpeg("train", index)  # Deterministic.
        image = np.asarray(Image.open(io.BytesIO(data)).convert("L"), float)
        sizes.append(len(data))
        areas.append(image.size)
        assert 200 <= max(image.shape) <= 500
        # Edges and texture at every scale: neither flat nor white noise.
        detail.append(np.abs(np.diff(image, axis=1)).mean())
    assert 70_000 < np.mean(sizes) < 160_000  # ImageNet: ~110 KB a JPEG.
    assert 100_000 < np.mean(areas) < 200_000  # ImageNet: ~400 x 350 pixels.
    assert 3 < np.mean(detail) < 40


def _rows(data, count):
    """(labels, image hashes) of the next `count` training rows."""
    labels, hashes = [], []
    while len(labels) < count:
        batch = next(data.train)
        labels.extend(batch["labels"].tolist())
        hashes.extend(hashlib.sha1(image.tobytes()).hexdigest() for image in batch["images"])
    return labels[:count], hashes[:count]


def test_augmentation_is_keyed_by_seed_epoch_and_index(data_dir):
    config = _config(data_dir)
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
    # Another run with the same seed, in two worker processes: identical batches.
    workers = _make(_config(data_dir, worker_count=2), global_batch_size=500).train
    try:
        for a, b in zip(first[:4], _take(workers, 4), strict=True):
            np.testing.assert_array_equal(a["images"], b["images"])
            np.testing.assert_array_equal(a["labels"], b["labels"])
    finally:
        workers.close()
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


def test_processes_take_blocks_of_one_global_order(data_dir):
    single = _take(_make(_config(data_dir), global_batch_size=100).train, 3)
    shares = [
        _make(_config(data_dir), global_batch_size=100, process_index=i, process_count=4).train
        for i in range(4)
    ]
    for want in single:
        got = [next(share) for share in shares]
        for key in TRAIN_KEYS:
            np.testing.assert_array_equal(want[key], np.concatenate([g[key] for g in got]))


def test_resume_from_state_of_another_process_count(data_dir):
    shares = [_make(_config(data_dir), process_index=i, process_count=2) for i in range(2)]
    for share in shares:
        _take(share.train, 3)
    state = shares[0].train.get_state()
    assert state == shares[1].train.get_state() == {"global_batch": 3}
    halves = [_take(share.train, 2) for share in shares]
    expected = [
        {k: np.concatenate([h[step][k] for h in halves]) for k in TRAIN_KEYS} for step in range(2)
    ]
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
    # 41 examples: shares of 11, 10, 10, 10; processes 1-3 end with an all-padding batch.
    config = _config(data_dir, num_eval_examples=41)
    last = list(
        _make(config, global_batch_size=40, process_index=3, process_count=4).eval_batches()
    )
    assert len(last) == 2 and not last[1]["weights"].any() and not last[1]["images"].any()


class _Records(list):
    """A list of records standing in for a TFDS data source (with its dataset_info)."""

    dataset_info = tfds.builder("imagenet2012").info


def test_imagenet_on_mock_data(tmp_path):
    rng = np.random.default_rng(0)
    jpegs = [_jpeg(local_jpeg.generate_image(rng, 90 + 7 * i, 120)) for i in range(12)]

    def as_data_source(builder, split, decoders=None, deserialize_method=None):
        del deserialize_method
        assert builder.name == "imagenet2012" and split in ("train", "validation")
        # JPEG bytes reach the pipeline undecoded, so the crop can steer decoding.
        assert isinstance(decoders["image"], tfds.decode.SkipDecoding)
        return _Records({"image": jpeg, "label": 7 * i} for i, jpeg in enumerate(jpegs))

    config = _config(tmp_path, name="imagenet2012", image_size=64, num_eval_examples=10)
    policy = tfds.testing.MockPolicy.USE_CODE
    with tfds.testing.mock_data(policy=policy, as_data_source_fn=as_data_source):
        data = _make(config, global_batch_size=8, process_index=1, process_count=2)
        train = _take(data.train, 4)  # Past an epoch of 12 examples.
        batches = list(data.eval_batches())
    assert data.num_classes == 1000
    labels = []
    for batch in train:
        assert batch["images"].shape == (4, 64, 64, 3) and batch["images"].dtype == np.uint8
        assert batch["labels"].dtype == np.int32
        labels += batch["labels"].tolist()
    assert set(labels) <= {7 * i for i in range(12)} and len(set(labels)) > 6
    assert len(batches) == 2 and all(b["images"].shape == (4, 64, 64, 3) for b in batches)
    assert [b["weights"].tolist() for b in batches] == [[1, 1, 1, 1], [1, 0, 0, 0]]
    # Process 1 owns eval examples 1, 3, ...: a center crop of each.
    center = augment.crop_to(jpegs[1], lambda h, w: augment.center_crop_box(h, w, 224 / 256), 64)
    np.testing.assert_array_equal(batches[0]["images"][0], center)
    assert batches[0]["labels"][0] == 7


def test_missing_imagenet_names_the_build_command(tmp_path):
    with pytest.raises(DatasetNotPreparedError) as error:
        _make(_config(tmp_path, name="imagenet2012"))
    message = str(error.value)
    assert "imagenet2012" in message and "downloads/manual" in message
    assert f"tfds build imagenet2012 --file_format=array_record --data_dir={tmp_path}" in message


def test_bad_configs(tmp_path):
    with pytest.raises(ConfigError, match="Unknown image dataset"):
        _make(_config(tmp_path, name="cifar10"))
    with pytest.raises(ConfigError, match="multiple"):
        _make(_config(tmp_path), global_batch_size=7, process_count=2)
    config = _config(tmp_path)
    del config["worker_count"]
    with pytest.raises(ConfigError, match="worker_count"):
        _make(config)
