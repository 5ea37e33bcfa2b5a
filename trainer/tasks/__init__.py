"""The model families, the one table of them: each family's task (model, loss,
evaluation: :mod:`trainer.tasks.base`) and its input pipeline, by ``model.name``.

The trainer runs every task through the same code path: it never branches on the
model. A family's task builder gets ``open_data`` (this process's pipeline, or
None) and calls it only after checking the model's config, so that a mistake there
fails before a dataset is read or a vocabulary trained.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import ml_collections

from trainer.errors import ConfigError
from trainer.input import chat_template, imagenet, movielens, pipelines
from trainer.input import tokenizer as tokenizer_lib
from trainer.input import translation as translation_data
from trainer.input.language import pipeline as language
from trainer.tasks import (
    classification,
    language_model,
    masked_lm,
    recommendation,
    translation,
)
from trainer.tasks.base import REPLICAS, Task

__all__ = ["REPLICAS", "Task", "make_task", "open_data", "run_file_names"]


@dataclasses.dataclass(frozen=True)
class Family:
    """A model family: ``make_task(config, open_data)`` and ``make_data(data_config,
    options)``, the builders of its task and of its input pipeline, and the names of
    the files its runs keep for later use (``Task.run_files``: the tokenizer)."""

    make_task: Callable[..., Task]
    make_data: Callable[..., Any]
    run_files: tuple[str, ...] = ()


FAMILIES = {
    "transformer": Family(
        translation.make_task,
        translation_data.make_translation_data,
        (translation_data.VOCAB_FILE,),
    ),
    "resnet": Family(classification.make_task, imagenet.make_image_data),
    "ncf": Family(recommendation.make_task, movielens.make_movielens_data),
    "decoder": Family(
        language_model.make_task,
        language.make_language_data,
        (tokenizer_lib.SPM_FILE, *tokenizer_lib.HF_FILES, chat_template.TEMPLATE_FILE),
    ),
    "bert": Family(
        masked_lm.make_task,
        language.make_language_data,
        (tokenizer_lib.SPM_FILE, *tokenizer_lib.HF_FILES),
    ),
}


def family(config: ml_collections.ConfigDict) -> Family:
    """The family ``config.model.name`` names.

    Raises:
      ConfigError: naming the known ones.
    """
    name = config.model.name
    if name not in FAMILIES:
        raise ConfigError(f"model.name must be one of {sorted(FAMILIES)}, got '{name}'")
    return FAMILIES[name]


def run_file_names(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The files a run of ``config``'s family keeps in its work directory (and an
    export beside the parameters) for what later uses the run alone."""
    return family(config).run_files


def open_data(config: ml_collections.ConfigDict, process_index: int = 0, process_count: int = 1):
    """This process's input pipeline of ``config`` (``TranslationData``, ``ImageData``,
    ``MovieLensData``): the data benchmark, the prepare command and tests open it alone."""
    return pipelines.open_pipeline(
        family(config).make_data, config, process_index=process_index, process_count=process_count
    )


def make_task(
    config: ml_collections.ConfigDict,
    *,
    process_index: int,
    process_count: int,
    with_data: bool = True,
) -> Task:
    """Builds the task of ``config``'s model family.

    ``with_data=False`` builds the model, loss and shapes from the config alone,
    opening no dataset (no train or eval data, no host evaluation): enough to
    compile the training step ahead of time (:mod:`trainer.aot`).
    """
    chosen = family(config)
    open_ = None
    if with_data:
        open_ = functools.partial(open_data, config, process_index, process_count)
    return chosen.make_task(config, open_)
