"""Preparing the embedded (locally generated) TFDS datasets, safely."""

import os
import shutil
import tempfile

import tensorflow_datasets as tfds


def prepare_locally(builder_cls: type[tfds.core.DatasetBuilder], data_dir: str) -> None:
    """Builds ``builder_cls`` as array_record files under ``data_dir`` if missing.

    Idempotent and safe to call from several processes at once: each builds into
    its own temporary directory and atomically renames it into place; a process
    that loses the race discards its copy (the copies hold the same examples).

    Args:
      builder_cls: a builder that generates its data without downloads.
      data_dir: the TFDS data directory (the dataset lands in
        ``<data_dir>/<name>/<version>``).
    """
    builder = builder_cls(data_dir=data_dir, file_format="array_record")
    if builder.is_prepared():
        return
    final_dir = builder.data_path
    os.makedirs(os.path.dirname(final_dir), exist_ok=True)
    tmp_data_dir = tempfile.mkdtemp(prefix=f".{builder.name}-", dir=data_dir)
    try:
        tmp_builder = builder_cls(data_dir=tmp_data_dir, file_format="array_record")
        tmp_builder.download_and_prepare(download_dir=os.path.join(tmp_data_dir, "downloads"))
        try:
            os.rename(tmp_builder.data_path, final_dir)
        except OSError:
            # Another process renamed its (equivalent) copy first.
            if not builder_cls(data_dir=data_dir, file_format="array_record").is_prepared():
                raise
    finally:
        shutil.rmtree(tmp_data_dir, ignore_errors=True)
