"""`tiny_images`: a local, synthetic 10-class image classification TFDS dataset.

The images are generated from code (no download), deterministically from a fixed
seed: 32x32 RGB uint8, 5,000 in "train" and 500 in "validation". Every class is
a sinusoidal stripe pattern with its own orientation, spatial frequency and pair
of colours; every image draws a random phase (a shift of the stripes), a small
jitter of orientation, frequency and colours, and per-pixel noise. So a small CNN
learns the classes quickly (colour alone already separates most of them), but
not perfectly at a glance: the jitter and noise make neighbouring classes overlap.

Images are stored as raw uint8 tensors rather than PNG/JPEG, so that reading
them needs no image library; the features are {"image": uint8 [32, 32, 3],
"label": ClassLabel(10)}, like `imagenet2012`'s apart from the fixed shape.
Preparation writes array_record files with TFDS's own writer, without
TensorFlow (see `tiny_movielens`, which uses the same technique).
"""

from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds

from trainer.input.builders import base

DATASET_NAME = "tiny_images"
IMAGE_SIZE = 32
NUM_CLASSES = 10
SPLIT_SIZES = {"train": 5000, "validation": 500}
SEED = 20240701
# Per-pixel Gaussian noise (in uint8 levels) and per-image jitters.
_NOISE = 24.0
_COLOUR_JITTER = 18.0
_ANGLE_JITTER = np.pi / 24
_FREQUENCY_JITTER = 0.1


def _class_parameters() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(angles, frequencies in cycles per image, foreground, background colours) per class."""
    rng = np.random.default_rng((SEED, 0))
    # Orientations spread over [0, pi) in a shuffled order, so that classes with
    # similar colours do not also share an orientation.
    angles = rng.permutation(NUM_CLASSES) * np.pi / NUM_CLASSES
    frequencies = 2.0 + 4.0 * rng.permutation(NUM_CLASSES) / (NUM_CLASSES - 1)
    foreground = rng.uniform(40, 215, size=(NUM_CLASSES, 3))
    background = rng.uniform(40, 215, size=(NUM_CLASSES, 3))
    return angles, frequencies, foreground, background


def generate_images(split: str) -> tuple[np.ndarray, np.ndarray]:
    """Generates a split deterministically.

    Args:
      split: "train" or "validation".

    Returns:
      (images uint8 [N, 32, 32, 3], labels int64 [N]) with N = SPLIT_SIZES[split];
      the labels cycle through the classes in a shuffled order.
    """
    count = SPLIT_SIZES[split]
    rng = np.random.default_rng((SEED, 1 + list(SPLIT_SIZES).index(split)))
    angles, frequencies, foreground, background = _class_parameters()
    labels = rng.permutation(np.arange(count) % NUM_CLASSES)
    angle = angles[labels] + rng.normal(scale=_ANGLE_JITTER, size=count)
    frequency = frequencies[labels] * (1 + rng.normal(scale=_FREQUENCY_JITTER, size=count))
    phase = rng.uniform(0, 2 * np.pi, size=count)  # A random shift of the stripes.
    coords = np.arange(IMAGE_SIZE) / IMAGE_SIZE
    y, x = coords[None, :, None], coords[None, None, :]
    along = x * np.cos(angle)[:, None, None] + y * np.sin(angle)[:, None, None]
    wave = 0.5 * (1 + np.sin(2 * np.pi * frequency[:, None, None] * along + phase[:, None, None]))
    fg = foreground[labels] + rng.normal(scale=_COLOUR_JITTER, size=(count, 3))
    bg = background[labels] + rng.normal(scale=_COLOUR_JITTER, size=(count, 3))
    images = bg[:, None, None, :] + (fg - bg)[:, None, None, :] * wave[..., None]
    images += rng.normal(scale=_NOISE, size=images.shape)
    return np.clip(np.round(images), 0, 255).astype(np.uint8), labels.astype(np.int64)


class TinyImages(base.LocalBuilder):
    """Synthetic 32x32 stripe images of 10 classes, shaped like imagenet2012."""

    def features(self) -> tfds.features.FeatureConnector:
        return tfds.features.FeaturesDict(
            {
                # Raw bytes: no image codec (and no TensorFlow) to read them.
                "image": tfds.features.Tensor(
                    shape=(IMAGE_SIZE, IMAGE_SIZE, 3),
                    dtype=np.uint8,
                    encoding=tfds.features.Encoding.BYTES,
                ),
                "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
            }
        )

    SUPERVISED_KEYS = ("image", "label")
    SPLITS = tuple(SPLIT_SIZES)

    def _generate_examples(self, split: str) -> Iterator:
        images, labels = generate_images(split)
        for index in range(len(labels)):
            yield index, {"image": images[index], "label": labels[index]}


def prepare_tiny_images(data_dir: str) -> None:
    """Builds `tiny_images` under `data_dir` if missing (see `prepare_locally`)."""
    base.prepare_locally(TinyImages, data_dir)
