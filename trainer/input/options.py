"""The data options every pipeline shares, read from the config's `data` section.

Every config declares these keys (see configs/); a pipeline reads its own extra
keys with `read`. A missing key is a ConfigError naming it: no default is
hidden here.
"""

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

from tensorflow_datasets.core import constants as tfds_constants

from trainer.errors import ConfigError


def read(config: Any, types: Mapping[str, Callable[[Any], Any]]) -> dict[str, Any]:
    """`{key: kind(config[key])}` for every key of `types`; ConfigError if one is missing."""
    missing = [key for key in types if key not in config]
    if missing:
        raise ConfigError(f"The data config has no {missing} key(s); configs/ declares them all.")
    return {key: kind(config[key]) for key, kind in types.items()}


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """The options of one process's input pipeline.

    Attributes:
      name: TFDS dataset name (or an embedded one, e.g. "tiny_translation").
      data_dir: TFDS data directory (a local path or an epath URL).
      train_split: TFDS split (slices allowed, e.g. "train[:10%]") to train on.
      worker_count: grain worker processes producing training batches; 0 = in this
        process, on a few threads.
      worker_buffer_size: batches each worker (or the in-process reader) prepares ahead.
      seed: seed of the order of examples and of everything random in them.
      global_batch: rows per step over all processes.
      process_index: this process, in [0, process_count).
      process_count: processes reading data.
    """

    name: str
    data_dir: str
    train_split: str
    worker_count: int
    worker_buffer_size: int
    seed: int
    global_batch: int
    process_index: int
    process_count: int

    @property
    def local_batch(self) -> int:
        """Rows this process reads per step."""
        return self.global_batch // self.process_count

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        global_batch_size: int,
        seed: int,
        process_index: int,
        process_count: int,
    ) -> "DataOptions":
        """Reads and checks the shared keys of a `data` config section."""
        keys = read(
            config,
            {"name": str, "train_split": str, "worker_count": int, "worker_buffer_size": int},
        )
        if "data_dir" not in config:
            raise ConfigError("The data config has no ['data_dir'] key; configs/ declares it.")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ConfigError(f"Bad process_index={process_index} / process_count={process_count}.")
        if global_batch_size < process_count or global_batch_size % process_count:
            raise ConfigError(
                f"global_batch_size={global_batch_size} must be a positive multiple of "
                f"process_count={process_count}."
            )
        if keys["worker_count"] < 0 or keys["worker_buffer_size"] < 1:
            raise ConfigError(
                f"worker_count={keys['worker_count']} must be >= 0 and worker_buffer_size="
                f"{keys['worker_buffer_size']} >= 1."
            )
        return cls(
            data_dir=data_dir(config["data_dir"]),
            seed=seed % 2**32,
            global_batch=global_batch_size,
            process_index=process_index,
            process_count=process_count,
            **keys,
        )


def optional_str(value: Any) -> str | None:
    """A string key that may be None (e.g. a path that has a computed default)."""
    return None if value is None else str(value)


def data_dir(value: str | None) -> str:
    """The TFDS data directory: the configured one, or TFDS's default.

    Raises:
      ConfigError: if it is a file.
    """
    path = os.path.expanduser(str(value or tfds_constants.DATA_DIR))
    if "://" not in path and os.path.isfile(path):
        raise ConfigError(f"data.data_dir={path} is a file, not a directory")
    return path
