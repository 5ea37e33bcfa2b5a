"""Reading a data config, shared by the input pipelines."""

import os
from collections.abc import Callable
from typing import Any

from tensorflow_datasets.core import constants as tfds_constants

from trainer.errors import ConfigError

_REQUIRED = object()


def config_getter(config: Any) -> Callable[..., Any]:
    """``get(key, default)`` on a data config; a missing key without a default
    is a ConfigError naming it."""

    def get(key: str, default: Any = _REQUIRED) -> Any:
        if key in config:
            return config[key]
        if default is _REQUIRED:
            raise ConfigError(f"The data config has no '{key}' key.")
        return default

    return get


def local_batch_size(global_batch_size: int, process_index: int, process_count: int) -> int:
    """Rows this process reads per step, after checking the process split."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(f"Bad process_index={process_index} / process_count={process_count}.")
    if global_batch_size < process_count or global_batch_size % process_count:
        raise ConfigError(
            f"global_batch_size={global_batch_size} must be a positive multiple of "
            f"process_count={process_count}."
        )
    return global_batch_size // process_count


def data_dir(value: str | None) -> str:
    """The TFDS data directory: the configured one, or TFDS's default."""
    return os.path.expanduser(value or tfds_constants.DATA_DIR)
