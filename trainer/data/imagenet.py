"""Image classification input pipeline: TFDS images -> crops and flips -> grain batches.

Serves `imagenet2012` (prepared by the user, see `DatasetNotPreparedError`) and the
embedded `tiny_images` through one code path. The host only crops, resizes and flips,
and hands out uint8 pixels: normalisation (mean/std) happens on device, in the model, as
in the MLPerf multipod host pipeline, so the host does the least work per image and
moves 1 byte per channel instead of 4.

Data flow, training: split "train" --> process i of n owns examples i, i+n, ... -->
grain shuffles that share, reseeded every epoch (`shuffle().repeat()`) --> each example is
decoded (TFDS decodes imagenet's JPEG bytes itself, with OpenCV or Pillow, to a uint8
[H, W, 3] array; `tiny_images` stores raw uint8 arrays) --> an Inception-style random
resized crop (area 8%-100% of the image, aspect ratio 3/4-4/3, 10 tries, then a center
crop) is resized to S x S and flipped horizontally with probability 1/2. The crop and
flip are a function of (seed, epoch, example index) alone, so they do not depend on the
number of processes, the read threads or resumption; grain's iterator state (an index)
is the whole checkpoint.

Eval: the first `num_eval_examples` of `eval_split`, process i owning i, i+n, ... -->
resize the shorter side to S * 256/224 and take the center S x S (done as one resize of
the center crop of side shorter * 224/256) --> batches of the local batch size, padded
with all-zero rows of weight 0 so every process yields the same number of batches.

For `tiny_images` (32x32 images) the random crop keeps at least 25% of the area (8% of a
32x32 image is a 9x9 patch, too little of a stripe pattern) and eval uses the whole image.
"""

import dataclasses
import io
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from trainer.data import options, tiny_images
from trainer.data.translation import DatasetNotPreparedError
from trainer.errors import ConfigError

__all__ = ["DatasetNotPreparedError", "ImageData", "make_image_data"]

Batch = dict[str, np.ndarray]
IMAGENET = "imagenet2012"
TRAIN_KEYS = ("images", "labels")
EVAL_KEYS = ("images", "labels", "weights")
_DEFAULT_READ_THREADS = 2
_PREFETCH_BUFFER = 64  # Examples decoded ahead of the consumer.
_CROP_TRIES = 10
_MAX_LOG_ASPECT = math.log(4 / 3)


@dataclasses.dataclass(frozen=True)
class _DatasetSpec:
    default_image_size: int
    min_crop_area: float  # Smallest fraction of the image a training crop covers.
    eval_crop_fraction: float  # Side of the eval center crop / shorter side.


_DATASETS = {
    IMAGENET: _DatasetSpec(224, 0.08, 224 / 256),
    tiny_images.DATASET_NAME: _DatasetSpec(tiny_images.IMAGE_SIZE, 0.25, 1.0),
}


@dataclasses.dataclass(frozen=True)
class ImageData:
    """The input side of an image classification run, for one process.

    Attributes:
      train: Endless, checkpointable (get_state/set_state) iterator of training batches:
        "images" uint8 [b, S, S, 3], "labels" int32 [b], b = global batch / processes.
      eval_batches: Returns a fresh finite iterator of eval batches: "images" uint8
        [b, S, S, 3], "labels" int32 [b], "weights" float32 [b] (1 real, 0 padding).
        Every process yields the same number of batches; padding rows are all zero.
      num_classes: Number of labels (labels are in [0, num_classes)).
    """

    train: grain.DatasetIterator
    eval_batches: Callable[[], Iterator[Batch]]
    num_classes: int


@dataclasses.dataclass(frozen=True)
class _Options:
    name: str
    data_dir: str
    image_size: int
    eval_split: str
    num_eval_examples: int
    prepare: bool
    read_threads: int
    local_batch: int
    seed: int
    process_index: int
    process_count: int


def make_image_data(
    data_config: Any,
    *,
    global_batch_size: int,
    seed: int,
    process_index: int,
    process_count: int,
) -> ImageData:
    """Builds this process's training iterator and eval batches.

    Args:
      data_config: `ml_collections.ConfigDict` (or mapping) with keys name
        ("imagenet2012" or "tiny_images"), data_dir; optional: image_size (224 for
        imagenet2012, 32 for tiny_images), eval_split ("validation"), num_eval_examples
        (-1: all), prepare (True: build tiny_images if missing), read_threads (2).
      global_batch_size: Examples per step over all processes (train and eval); must
        divide by `process_count`.
      seed: Seed of shuffling, crops and flips.
      process_index: This process, in [0, process_count).
      process_count: Number of processes reading data.

    Returns:
      The `ImageData` of this process.

    Raises:
      DatasetNotPreparedError: If the TFDS dataset is not prepared in `data_dir`.
      ConfigError: On an inconsistent config.
    """
    opts = _parse_options(data_config, global_batch_size, seed, process_index, process_count)
    if opts.name == tiny_images.DATASET_NAME:
        if opts.prepare:
            tiny_images.prepare_tiny_images(opts.data_dir)
        elif not tiny_images.TinyImages(data_dir=opts.data_dir).is_prepared():
            raise DatasetNotPreparedError(
                f"Dataset '{opts.name}' is not prepared in data_dir={opts.data_dir}: set "
                "prepare=True in the data config or call "
                f"trainer.data.tiny_images.prepare_tiny_images({opts.data_dir!r})."
            )
    train_source = _open_split(opts, "train")
    eval_source = _open_split(opts, opts.eval_split)
    num_classes = int(train_source.dataset_info.features["label"].num_classes)
    return ImageData(
        train=_train_iterator(train_source, opts),
        eval_batches=_eval_function(eval_source, opts),
        num_classes=num_classes,
    )


def _parse_options(
    config: Any, global_batch_size: int, seed: int, process_index: int, process_count: int
) -> _Options:
    get = options.config_getter(config)
    local_batch = options.local_batch_size(global_batch_size, process_index, process_count)
    name = get("name")
    if name not in _DATASETS:
        raise ConfigError(f"Unknown image dataset '{name}'; expected one of {list(_DATASETS)}.")
    opts = _Options(
        name=name,
        data_dir=options.data_dir(get("data_dir", None)),
        image_size=int(get("image_size", _DATASETS[name].default_image_size)),
        eval_split=get("eval_split", "validation"),
        num_eval_examples=int(get("num_eval_examples", -1)),
        prepare=bool(get("prepare", True)),
        read_threads=int(get("read_threads", _DEFAULT_READ_THREADS)),
        local_batch=local_batch,
        seed=seed % 2**32,  # grain seeds are uint32.
        process_index=process_index,
        process_count=process_count,
    )
    if opts.image_size < 1:
        raise ConfigError(f"image_size={opts.image_size} must be >= 1.")
    if opts.num_eval_examples == 0 or opts.num_eval_examples < -1:
        raise ConfigError(f"num_eval_examples={opts.num_eval_examples}: use -1 (all) or > 0.")
    return opts


def _not_prepared_message(name: str, data_dir: str, detail: str) -> str:
    manual = ""
    if name == IMAGENET:
        # ImageNet cannot be downloaded by TFDS: its licence needs a manual download.
        manual = (
            f"download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from "
            f"image-net.org into {os.path.join(data_dir, 'downloads', 'manual')}, then "
        )
    return (
        f"TFDS dataset '{name}' {detail} in data_dir={data_dir}. Prepare it: {manual}run "
        f"`tfds build {name} --file_format=array_record --data_dir={data_dir}` (needs "
        "TensorFlow on the preparing machine; copy the result here)."
    )


def _open_split(opts: _Options, split: str) -> Sequence[Mapping[str, Any]]:
    """Opens a random-access TFDS split, mapping "not prepared" to one clear error."""
    try:
        # download=False: never start a download (and preparation) as a side effect.
        return tfds.data_source(opts.name, split=split, data_dir=opts.data_dir, download=False)
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


def as_rgb(image: Any) -> np.ndarray:
    """A uint8 [H, W, 3] array from a decoded image array or encoded (JPEG/PNG) bytes."""
    if isinstance(image, bytes):
        with Image.open(io.BytesIO(image)) as decoded:
            return np.asarray(decoded.convert("RGB"))
    image = np.asarray(image, dtype=np.uint8)
    if image.ndim == 2:
        image = image[..., None]
    if image.shape[-1] == 1:  # Grayscale.
        return np.repeat(image, 3, axis=-1)
    return image[..., :3]  # Drops an alpha channel, if any.


def random_crop_box(
    height: int, width: int, rng: np.random.Generator, min_area: float
) -> tuple[int, int, int, int]:
    """An Inception-style random crop: (top, left, crop height, crop width).

    Area uniform in [min_area, 1] of the image, log-uniform aspect ratio (w/h) in
    [3/4, 4/3]; after `_CROP_TRIES` crops that do not fit, the central square-ish crop.
    """
    area = height * width
    for _ in range(_CROP_TRIES):
        target = area * rng.uniform(min_area, 1.0)
        aspect = math.exp(rng.uniform(-_MAX_LOG_ASPECT, _MAX_LOG_ASPECT))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    # Fallback: the largest center crop whose aspect ratio is within bounds.
    ratio = width / height
    if ratio < 3 / 4:
        w, h = width, round(width * 4 / 3)
    elif ratio > 4 / 3:
        w, h = round(height * 4 / 3), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def center_crop_box(height: int, width: int, fraction: float) -> tuple[int, int, int, int]:
    """The central square of side `fraction` * shorter side: (top, left, side, side)."""
    side = max(1, round(min(height, width) * fraction))
    return (height - side) // 2, (width - side) // 2, side, side


def crop_and_resize(image: np.ndarray, box: tuple[int, int, int, int], size: int) -> np.ndarray:
    """The `box` (top, left, h, w) of `image`, resized (bilinear) to uint8 [size, size, 3]."""
    top, left, h, w = box
    if (h, w) == (size, size):
        return np.ascontiguousarray(image[top : top + h, left : left + w])
    # One resampling step from the box (PIL antialiases when shrinking).
    resized = Image.fromarray(image).resize(
        (size, size), Image.Resampling.BILINEAR, box=(left, top, left + w, top + h)
    )
    return np.asarray(resized)


def _train_iterator(source: Sequence[Mapping[str, Any]], opts: _Options) -> grain.DatasetIterator:
    # Shuffles example indices (not examples) so the crop can be keyed by the index.
    share = grain.MapDataset.range(len(source))[opts.process_index :: opts.process_count]
    if len(share) == 0:
        raise ConfigError(
            f"Split 'train' of {opts.name} has {len(source)} examples, none for process "
            f"{opts.process_index} of {opts.process_count}."
        )
    share_size = len(share)
    min_area = _DATASETS[opts.name].min_crop_area

    def example(position: int, index: int) -> Batch:
        # `position` counts over the repeated share: it gives the epoch.
        epoch = position // share_size
        rng = np.random.default_rng((opts.seed, epoch, index))
        record = source[index]
        image = as_rgb(record["image"])
        box = random_crop_box(image.shape[0], image.shape[1], rng, min_area)
        image = crop_and_resize(image, box, opts.image_size)
        if rng.random() < 0.5:
            image = image[:, ::-1]
        return {"images": np.ascontiguousarray(image), "labels": np.int32(record["label"])}

    rows = share.shuffle(seed=opts.seed).repeat().map_with_index(example)
    read = grain.ReadOptions(num_threads=opts.read_threads, prefetch_buffer_size=_PREFETCH_BUFFER)
    return iter(rows.to_iter_dataset(read).batch(opts.local_batch, drop_remainder=True))


def _eval_function(
    source: Sequence[Mapping[str, Any]], opts: _Options
) -> Callable[[], Iterator[Batch]]:
    """Returns eval_batches() over this process's examples, i, i+n, ... of the first N."""
    total = len(source) if opts.num_eval_examples < 0 else min(len(source), opts.num_eval_examples)
    indices = np.arange(opts.process_index, total, opts.process_count)
    # Sized by the largest share so that every process runs the same number of
    # (collective) eval steps; smaller shares end with all-zero rows.
    num_batches = math.ceil(math.ceil(total / opts.process_count) / opts.local_batch)
    size, fraction = opts.image_size, _DATASETS[opts.name].eval_crop_fraction

    def example(row: int) -> Batch:
        if row >= len(indices):
            return {
                "images": np.zeros((size, size, 3), np.uint8),
                "labels": np.int32(0),
                "weights": np.float32(0),
            }
        record = source[int(indices[row])]
        image = as_rgb(record["image"])
        box = center_crop_box(image.shape[0], image.shape[1], fraction)
        return {
            "images": crop_and_resize(image, box, size),
            "labels": np.int32(record["label"]),
            "weights": np.float32(1),
        }

    read = grain.ReadOptions(num_threads=opts.read_threads, prefetch_buffer_size=_PREFETCH_BUFFER)
    rows = grain.MapDataset.range(num_batches * opts.local_batch).map(example)

    def eval_batches() -> Iterator[Batch]:
        return iter(rows.to_iter_dataset(read).batch(opts.local_batch, drop_remainder=True))

    return eval_batches
