"""Opening TFDS splits: prepared ones, embedded (locally generated) ones, or a clear error.

Every pipeline reads random-access TFDS `data_source`s over array_record files
(no TensorFlow). Embedded datasets are generated from code and prepared on first
use; every other dataset must be prepared beforehand with `tfds build`, and a
missing one ends in one `DatasetNotPreparedError` that says how.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import tensorflow_datasets as tfds

from trainer.errors import UserError
from trainer.input.builders import (
    base,
    local_jpeg,
    local_movielens,
    tiny_images,
    tiny_movielens,
    tiny_translation,
)

# The datasets this project generates itself, by name.
EMBEDDED: dict[str, type[tfds.core.DatasetBuilder]] = {
    tiny_translation.DATASET_NAME: tiny_translation.TinyTranslation,
    tiny_images.DATASET_NAME: tiny_images.TinyImages,
    tiny_movielens.DATASET_NAME: tiny_movielens.TinyMovielens,
    local_jpeg.DATASET_NAME: local_jpeg.LocalJpeg,
    local_movielens.DATASET_NAME: local_movielens.LocalMovielens,
}


class DatasetNotPreparedError(UserError):
    """The TFDS dataset is missing from `data_dir` (or not stored as array_record)."""


def prepare_embedded(name: str, data_dir: str) -> None:
    """Generates embedded dataset `name` under `data_dir` if missing; no-op for others."""
    if name in EMBEDDED:
        base.prepare_locally(EMBEDDED[name], data_dir)


def _not_prepared_message(name: str, data_dir: str, detail: str, manual: str) -> str:
    return (
        f"TFDS dataset '{name}' {detail} in data_dir={data_dir}. Prepare it: {manual}run "
        f"`tfds build {name} --file_format=array_record --data_dir={data_dir}` (needs "
        "TensorFlow and internet access on the preparing machine; copy the result here)."
    )


def open_split(
    name: str, split: str, data_dir: str, *, manual: str = "", **kwargs: Any
) -> Sequence[Mapping[str, Any]]:
    """A random-access TFDS split; embedded datasets are prepared first if missing.

    Args:
      name: TFDS dataset name.
      split: split, slices allowed ("train[:1000]").
      data_dir: TFDS data directory.
      manual: steps that come before `tfds build` (e.g. ImageNet's manual download),
        for the error message.
      **kwargs: passed to `tfds.data_source` (decoders, deserialize_method).

    Raises:
      DatasetNotPreparedError: the dataset is not prepared as array_record in `data_dir`.
    """
    prepare_embedded(name, data_dir)
    try:
        # download=False: never start a download (and preparation) as a side effect.
        return tfds.data_source(name, split=split, data_dir=data_dir, download=False, **kwargs)
    except tfds.core.DatasetNotFoundError:
        # `from None`: TFDS's message lists every dataset it knows, burying this one.
        message = _not_prepared_message(name, data_dir, "is not found", manual)
        raise DatasetNotPreparedError(message) from None
    except Exception as e:
        # Diagnosed after the fact: `tfds.testing.mock_data` fakes the source, not the files.
        builder = tfds.builder(name, data_dir=data_dir)
        if not builder.is_prepared():
            detail = "is not prepared"
        elif tfds.core.FileFormat.ARRAY_RECORD not in builder.info.available_file_formats():
            detail = f"is prepared as {builder.info.file_format.value}, not array_record,"
        else:
            raise
        raise DatasetNotPreparedError(_not_prepared_message(name, data_dir, detail, manual)) from e
