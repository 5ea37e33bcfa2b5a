"""Opening a run's input pipeline: the options every pipeline reads, read once.

The one place a pipeline is opened; which pipeline a model family has is the
table of :mod:`trainer.tasks`.
"""

from collections.abc import Callable
from typing import Any

from trainer.input.options import DataOptions


def open_pipeline(
    make: Callable[..., Any], config: Any, process_index: int = 0, process_count: int = 1
) -> Any:
    """``make(config.data, options)``: this process's input data of the pipeline ``make``."""
    opts = DataOptions.from_config(
        config.data,
        global_batch_size=config.global_batch_size,
        seed=config.seed,
        process_index=process_index,
        process_count=process_count,
    )
    return make(config.data, opts)
