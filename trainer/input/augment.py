"""Decoding and cropping images on the host: JPEG bytes -> one resampled S x S crop.

The crop box is chosen from the image's header alone, before decoding, so the JPEG
can be decoded at a reduced size when the crop allows it: libjpeg's DCT scaling
(Pillow's `draft`) decodes at 1/2, 1/4 or 1/8 scale for a fraction of the cost,
and is used whenever the crop still has at least S x S pixels at that scale. The
box (mapped to the reduced image) is then resampled once, straight to S x S
(Pillow's box resize: antialiased bilinear, no intermediate crop), and the result
is copied once, flipped or not, into the batch.
"""

import io
import math
from collections.abc import Callable

import numpy as np
from PIL import Image

Box = tuple[int, int, int, int]  # (top, left, height, width) in the full image.
_CROP_TRIES = 10
_MAX_LOG_ASPECT = math.log(4 / 3)


def random_crop_box(height: int, width: int, rng: np.random.Generator, min_area: float) -> Box:
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


def center_crop_box(height: int, width: int, fraction: float) -> Box:
    """The central square of side `fraction` * shorter side: (top, left, side, side)."""
    side = max(1, round(min(height, width) * fraction))
    return (height - side) // 2, (width - side) // 2, side, side


def open_image(image: bytes | np.ndarray) -> Image.Image:
    """A Pillow image of encoded bytes (header read only, not decoded) or of an array."""
    if isinstance(image, bytes):
        return Image.open(io.BytesIO(image))
    array = np.asarray(image, dtype=np.uint8)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    return Image.fromarray(array)


def decode_for_box(image: Image.Image, box: Box, size: int) -> tuple[Image.Image, tuple]:
    """Decodes `image` at the smallest DCT scale that keeps `box` >= size x size.

    Returns:
      The decoded image and the box in its pixels as Pillow's (left, upper, right,
      lower) floats.
    """
    top, left, h, w = box
    width, height = image.size
    if image.format == "JPEG":
        # Pillow picks the largest 1/2^k with width / 2^k >= requested width (same for
        # height); request the full-image size at which the box is exactly size x size.
        image.draft("RGB", (max(1, width * size // w), max(1, height * size // h)))
    image.load()
    sx, sy = image.size[0] / width, image.size[1] / height
    return image, (left * sx, top * sy, (left + w) * sx, (top + h) * sy)


def resize_box(image: Image.Image, box: tuple, size: int) -> np.ndarray:
    """The box of a decoded image, resampled once to uint8 [size, size, 3]."""
    if image.size == (size, size) and box == (0, 0, size, size):
        resized = image
    else:
        # reducing_gap=None: one resampling pass, no extra 2^k pre-reduction.
        resized = image.resize((size, size), Image.Resampling.BILINEAR, box=box, reducing_gap=None)
    if resized.mode != "RGB":  # Grayscale or CMYK JPEGs; cheap at S x S.
        resized = resized.convert("RGB")
    return np.asarray(resized)


def crop_to(
    image: bytes | np.ndarray, choose_box: Callable[[int, int], Box], size: int
) -> np.ndarray:
    """Decode -> box chosen from (height, width) -> one resample: uint8 [size, size, 3]."""
    opened = open_image(image)
    box = choose_box(opened.size[1], opened.size[0])
    decoded, scaled_box = decode_for_box(opened, box, size)
    return resize_box(decoded, scaled_box, size)
