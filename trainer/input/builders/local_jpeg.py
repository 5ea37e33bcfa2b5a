"""`local_jpeg`: ImageNet-size JPEGs generated locally, to measure the real image path.

Shaped like `imagenet2012` (features {"image": JPEG Image, "label": ClassLabel(1000)},
splits "train" and "validation"), with ImageNet's image statistics where they set
the host's cost, not its content:
  * sizes: the longer side is 500 for 60% of the images and uniform in [200, 500]
    otherwise; aspect ratios 4:3 (55%), 3:2 (20%), 1:1 (10%) or uniform in
    [1.1, 1.8]; a quarter portrait. The mean is about 420 x 350 pixels;
  * content like a photograph's, not flat noise: a "dead leaves" picture (overlapping
    shapes of power-law sizes, each with a colour gradient, i.e. edges and smooth
    regions at every scale) plus 1/f^0.85 texture, so the JPEG entropy decoder has
    about the work it has on real photographs;
  * JPEG quality uniform in 88..96 (4:2:0 chroma), giving about 110 KB a file
    (ImageNet's mean).
Labels cycle over the 1000 classes; the images carry no class signal (this dataset
measures throughput, not learning). Generation is deterministic (per-image seeds),
about 40 ms an image on one core.
"""

import io
from collections.abc import Iterator

import numpy as np
import tensorflow_datasets as tfds
from PIL import Image

from trainer.input.builders import base

DATASET_NAME = "local_jpeg"
NUM_CLASSES = 1000
SPLIT_SIZES = {"train": 2048, "validation": 256}
SEED = 20261123
_SHAPES = 150  # Dead-leaves shapes per image.
_TEXTURE = 26.0  # Standard deviation of the 1/f texture, in uint8 levels.


def image_size(rng: np.random.Generator) -> tuple[int, int]:
    """(height, width) drawn from the ImageNet-like size distribution above."""
    longer = 500 if rng.random() < 0.6 else int(rng.uniform(200, 500))
    aspect = rng.choice([4 / 3, 3 / 2, 1.0, rng.uniform(1.1, 1.8)], p=[0.55, 0.2, 0.1, 0.15])
    shorter = round(longer / aspect)
    return (longer, shorter) if rng.random() < 0.25 else (shorter, longer)


def _texture(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """Unit-variance noise with a 1/f^0.85 amplitude spectrum, [height, width, 3]."""
    fy = np.fft.fftfreq(height)[:, None]
    fx = np.fft.rfftfreq(width)[None, :]
    frequency = np.hypot(fx, fy)
    frequency[0, 0] = 1.0
    shape = (3, height, fx.shape[1])
    spectrum = (rng.normal(size=shape) + 1j * rng.normal(size=shape)) / frequency**0.85
    spectrum[:, 0, 0] = 0
    noise = np.fft.irfftn(spectrum, s=(height, width), axes=(1, 2))
    noise /= noise.std(axis=(1, 2), keepdims=True)
    return noise.transpose(1, 2, 0)


def generate_image(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A photograph-like uint8 [height, width, 3] picture (see the module docstring)."""
    canvas = np.empty((height, width, 3), np.float32)
    canvas[:] = rng.uniform(40, 220, 3)
    smallest, largest = 4.0, max(height, width) / 2
    # Power-law radii, many more small shapes than large ones; drawn back to front.
    radii = np.sort(smallest * (largest / smallest) ** (1 - rng.random(_SHAPES) ** 0.35))[::-1]
    for radius in radii:
        cy, cx = rng.uniform(0, height), rng.uniform(0, width)
        squash = rng.uniform(0.5, 1.5)
        reach = 1.5 * radius
        top, bottom = int(max(0, cy - reach)), int(min(height, cy + reach + 1))
        left, right = int(max(0, cx - reach)), int(min(width, cx + reach + 1))
        if top >= bottom or left >= right:
            continue
        y = np.arange(top, bottom)[:, None] - cy
        x = np.arange(left, right)[None, :] - cx
        inside = (x * squash) ** 2 + (y / squash) ** 2 < radius**2
        gradient = 1 + 0.25 * (x * rng.normal() + y * rng.normal()) / radius
        colour = rng.uniform(20, 235, 3) * gradient[..., None]
        region = canvas[top:bottom, left:right]
        region[inside] = colour[inside]
    canvas += _TEXTURE * _texture(rng, height, width)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def generate_jpeg(split: str, index: int) -> bytes:
    """The JPEG file of example `index` of `split` (deterministic)."""
    rng = np.random.default_rng((SEED, list(SPLIT_SIZES).index(split), index))
    pixels = generate_image(rng, *image_size(rng))
    encoded = io.BytesIO()
    Image.fromarray(pixels).save(encoded, "JPEG", quality=int(rng.integers(88, 97)))
    return encoded.getvalue()


class LocalJpeg(base.LocalBuilder):
    """ImageNet-size photograph-like JPEGs, generated locally."""

    def features(self) -> tfds.features.FeatureConnector:
        return tfds.features.FeaturesDict(
            {
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES),
            }
        )

    SUPERVISED_KEYS = ("image", "label")
    SPLITS = tuple(SPLIT_SIZES)

    def _generate_examples(self, split: str) -> Iterator:
        for index in range(SPLIT_SIZES[split]):
            # Bytes pass through TFDS's Image feature as they are (no re-encoding).
            yield index, {"image": generate_jpeg(split, index), "label": index % NUM_CLASSES}
