"""The input pipeline of each model family, by `config.model.name`.

The one place a run's data is opened: the trainer's tasks (which add the model),
the data benchmark and the prepare command all call `build`.
"""

from collections.abc import Callable
from typing import Any

from trainer.data import imagenet, movielens, translation
from trainer.data.options import DataOptions
from trainer.errors import ConfigError

PIPELINES: dict[str, Callable[..., Any]] = {
    "transformer": translation.make_translation_data,
    "resnet": imagenet.make_image_data,
    "ncf": movielens.make_movielens_data,
}


def build(config: Any, process_index: int = 0, process_count: int = 1) -> Any:
    """This process's input data (`TranslationData`, `ImageData` or `MovieLensData`)."""
    if config.model.name not in PIPELINES:
        raise ConfigError(f"model.name must be one of {sorted(PIPELINES)}: {config.model.name}")
    opts = DataOptions.from_config(
        config.data,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        process_index=process_index,
        process_count=process_count,
    )
    return PIPELINES[config.model.name](config.data, opts)
