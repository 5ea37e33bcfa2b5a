"""Image classification input pipeline: TFDS images -> crops and flips -> batches.

Serves `imagenet2012` (prepared by the user), the embedded `local_jpeg`
(ImageNet-size JPEGs generated here) and `tiny_images` through one code path. The
host only decodes, crops, resizes and flips, and hands out uint8 pixels:
normalisation (mean/std) happens on device, in the model, as in the MLPerf
multipod host pipeline, so the host does the least work per image and moves 1
byte per channel instead of 4.

Training: global row r is example `permute(r mod N)` of epoch `r // N` (the order
of `trainer.input.order`, reshuffled every epoch); its JPEG bytes are read
undecoded, an Inception-style random resized crop (area 8%-100%, aspect ratio
3/4-4/3, 10 tries, then a center crop) is chosen from the header, decoded at the
smallest DCT scale the crop allows, resized once to S x S and flipped with
probability 1/2 (see `trainer.input.augment`). Crop and flip are a function of
(seed, epoch, example) alone, so batches do not depend on the number of
processes, workers or threads, nor on resumption.

Eval: the first `num_eval_examples` of `eval_split`, process i owning i, i+n, ...
-> the center crop of side shorter * 224/256 resized to S x S (the usual "resize
the shorter side to S * 256/224, crop S x S", in one resample) -> batches padded
with all-zero rows of weight 0 so every process yields the same number.

For `tiny_images` (32x32 arrays) the random crop keeps at least 25% of the area
and eval uses the whole image.
"""

import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import grain
import numpy as np
import tensorflow_datasets as tfds

from trainer.errors import ConfigError
from trainer.input import augment, feed, options, order, source
from trainer.input.builders import local_jpeg, tiny_images
from trainer.input.options import DataOptions

Batch = dict[str, np.ndarray]
IMAGENET = "imagenet2012"
TRAIN_KEYS = ("images", "labels")
EVAL_KEYS = ("images", "labels", "weights")
_SHUFFLE = 11  # Stream of the order hash (see `order.epoch_order`).
# ImageNet cannot be downloaded by TFDS: its licence needs a manual download.
_IMAGENET_MANUAL = (
    "download ILSVRC2012_img_train.tar and ILSVRC2012_img_val.tar from image-net.org "
    "into {data_dir}/downloads/manual, then "
)


@dataclasses.dataclass(frozen=True)
class _DatasetSpec:
    min_crop_area: float  # Smallest fraction of the image a training crop covers.
    eval_crop_fraction: float  # Side of the eval center crop / shorter side.
    encoded: bool  # Images stored as JPEG bytes (read undecoded) rather than arrays.


_DATASETS = {
    IMAGENET: _DatasetSpec(0.08, 224 / 256, encoded=True),
    local_jpeg.DATASET_NAME: _DatasetSpec(0.08, 224 / 256, encoded=True),
    tiny_images.DATASET_NAME: _DatasetSpec(0.25, 1.0, encoded=False),
}


@dataclasses.dataclass(frozen=True)
class ImageData:
    """The input side of an image classification run, for one process.

    Attributes:
      train: Endless iterator of training batches with a global position
        (`feed.TrainBatches`): "images" uint8 [b, S, S, 3], "labels" int32 [b],
        b = global batch / processes.
      eval_batches: Returns a fresh finite iterator of eval batches: "images" uint8
        [b, S, S, 3], "labels" int32 [b], "weights" float32 [b] (1 real, 0 padding).
        Every process yields the same number of batches; padding rows are all zero.
      num_classes: Number of labels (labels are in [0, num_classes)).
    """

    train: feed.TrainBatches
    eval_batches: Callable[[], Iterator[Batch]]
    num_classes: int


@dataclasses.dataclass(frozen=True)
class ImageOptions:
    """The image-specific keys of the data config."""

    image_size: int
    eval_split: str
    num_eval_examples: int  # -1: the whole eval split.


def make_image_data(data_config: Any, opts: DataOptions) -> ImageData:
    """Builds this process's training iterator and eval batches.

    Args:
      data_config: the `data` config section: the `DataOptions` keys and image_size,
        eval_split, num_eval_examples.
      opts: The options every pipeline shares (`DataOptions.from_config`).

    Returns:
      The `ImageData` of this process.

    Raises:
      DatasetNotPreparedError: If the TFDS dataset is not prepared in `data_dir`.
      ConfigError: On an inconsistent config.
    """
    image_opts = ImageOptions(
        **options.read(
            data_config, {"image_size": int, "eval_split": str, "num_eval_examples": int}
        )
    )
    if opts.name not in _DATASETS:
        raise ConfigError(
            f"Unknown image dataset '{opts.name}'; expected one of {list(_DATASETS)}."
        )
    if image_opts.image_size < 1:
        raise ConfigError(f"image_size={image_opts.image_size} must be >= 1.")
    if image_opts.num_eval_examples == 0 or image_opts.num_eval_examples < -1:
        raise ConfigError(f"num_eval_examples={image_opts.num_eval_examples}: use -1 (all) or > 0.")
    train_source = open_images(opts.name, opts.train_split, opts.data_dir)
    eval_source = open_images(opts.name, image_opts.eval_split, opts.data_dir)
    if len(train_source) == 0:
        raise ConfigError(f"Split '{opts.train_split}' of {opts.name} is empty.")
    return ImageData(
        train=feed.TrainBatches(TrainBatchFn(train_source, opts, image_opts.image_size), opts),
        eval_batches=_eval_function(eval_source, opts, image_opts),
        num_classes=int(train_source.dataset_info.features["label"].num_classes),
    )


def open_images(name: str, split: str, data_dir: str) -> Sequence[Mapping[str, Any]]:
    """The split, with JPEG images left undecoded (bytes) so the crop can steer decoding."""
    kwargs = {}
    if name in _DATASETS and _DATASETS[name].encoded:
        kwargs["decoders"] = {"image": tfds.decode.SkipDecoding()}
    manual = _IMAGENET_MANUAL.format(data_dir=data_dir) if name == IMAGENET else ""
    return source.open_split(name, split, data_dir, manual=manual, **kwargs)


class TrainBatchFn:
    """This process's rows of a global training batch (picklable for worker processes)."""

    def __init__(self, images: Sequence[Mapping[str, Any]], opts: DataOptions, size: int):
        self.images, self.opts, self.size = images, opts, size
        self.min_area = _DATASETS[opts.name].min_crop_area

    def example(self, epoch: int, index: int) -> tuple[np.ndarray, bool, int]:
        """(crop uint8 [S, S, 3], flip, label) of one example in one epoch."""
        rng = np.random.default_rng((self.opts.seed, epoch, index))
        record = self.images[index]
        crop = augment.crop_to(
            record["image"],
            functools.partial(augment.random_crop_box, rng=rng, min_area=self.min_area),
            self.size,
        )
        return crop, bool(rng.random() < 0.5), int(record["label"])

    def __call__(self, batch_index: int) -> Batch:
        opts = self.opts
        rows = order.process_rows(
            batch_index, opts.global_batch, opts.process_index, opts.local_batch
        )
        epochs, indices = order.epoch_order(rows, len(self.images), opts.seed, _SHUFFLE)
        images = np.empty((len(rows), self.size, self.size, 3), np.uint8)
        labels = np.empty(len(rows), np.int32)
        for row, (epoch, index) in enumerate(zip(epochs.tolist(), indices.tolist(), strict=True)):
            crop, flip, labels[row] = self.example(epoch, index)
            images[row] = crop[:, ::-1] if flip else crop  # The one copy into the batch.
        return {"images": images, "labels": labels}


def _eval_function(
    images: Sequence[Mapping[str, Any]], opts: DataOptions, image_opts: ImageOptions
) -> Callable[[], Iterator[Batch]]:
    """Returns eval_batches() over this process's examples, i, i+n, ... of the first N."""
    total = len(images)
    if image_opts.num_eval_examples > 0:
        total = min(total, image_opts.num_eval_examples)
    share = feed.EvalShare.of(total, opts)
    size, fraction = image_opts.image_size, _DATASETS[opts.name].eval_crop_fraction
    center = functools.partial(augment.center_crop_box, fraction=fraction)

    batches = list(share.batch_indices())

    def eval_batch(number: int) -> Batch:
        records = [images[int(i)] for i in batches[number]]
        crops = np.zeros((len(records), size, size, 3), np.uint8)
        for row, record in enumerate(records):
            crops[row] = augment.crop_to(record["image"], center, size)
        batch = {
            "images": crops,
            "labels": np.array([r["label"] for r in records], np.int32),
            "weights": np.ones(len(records), np.float32),
        }
        return feed.pad_rows(batch, share.batch)

    def eval_batches() -> Iterator[Batch]:
        # A few threads: Pillow releases the GIL while it decodes.
        read = grain.ReadOptions(num_threads=feed.IN_PROCESS_THREADS, prefetch_buffer_size=2)
        dataset = grain.MapDataset.range(len(batches)).map(eval_batch).to_iter_dataset(read)
        return feed.Counted(iter(dataset), len(batches))

    return eval_batches
