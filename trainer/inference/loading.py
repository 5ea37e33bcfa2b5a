"""A trained model's parameters and config, from a run's work directory or an export.

Every use of a trained run starts here: the :class:`~trainer.inference.translator.Translator`,
the :class:`~trainer.inference.generator.Generator` and the exports read the parameters
of one checkpoint (the optimizer state is not read) or of an export
(``python -m trainer.export``, which keeps the run's config and tokenizer beside the
parameters), placed on this process's devices. The path is an ``epath`` from here on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath

from trainer import console
from trainer.errors import ConfigError, UserError
from trainer.training import evaluation
from trainer.training import experiment as experiment_lib
from trainer.workdir import run_config, storage

_ORBAX_MARKER = "_CHECKPOINT_METADATA"  # in every checkpoint Orbax wrote whole


@dataclasses.dataclass(frozen=True)
class Trained:
    """A trained model on this process's devices.

    Attributes:
      config: the run's config (with any overrides the loader was given).
      model: the model on a mesh of this process's devices (no data, no optimizer).
      params: the parameters in their logical shapes, in ``model``'s shardings.
      step: the training step of the parameters (None for an export).
      source: where they came from: a work directory or an export.
    """

    config: ml_collections.ConfigDict
    model: experiment_lib.Model
    params: Any
    step: int | None
    source: epath.Path


def is_export(directory: epath.Path) -> bool:
    """Whether ``directory`` is an export (parameters and config), not a work directory."""
    return (directory / _ORBAX_MARKER).exists() and (directory / run_config.FILE).exists()


def read_config(directory: epath.Path) -> ml_collections.ConfigDict:
    """The config of a work directory or an export.

    Raises:
      UserError: ``directory`` is neither, or its config is damaged.
    """
    if is_export(directory):
        file = directory / run_config.FILE
        try:
            return run_config.from_json(file.read_text())
        except ValueError as e:
            raise UserError(f"{file} is damaged ({' '.join(str(e).split())})") from None
    try:
        return run_config.load(directory)
    except FileNotFoundError:
        raise UserError(
            f"{directory} is neither a run's work directory (python -m trainer --workdir) nor "
            f"an export (python -m trainer.export --out): it has no {run_config.FILE}"
        ) from None


def load(
    path: str | epath.PathLike,
    *,
    family: str,
    step: int | None = None,
    config: ml_collections.ConfigDict | None = None,
) -> Trained:
    """The parameters of checkpoint ``step`` (default the newest) of a work directory,
    or of an export, with the model of ``family`` (``model.name``) to run them.

    Args:
      path: a work directory or an export (a local path or a URL).
      family: the ``model.name`` the caller runs (``transformer``, ``decoder``, ...).
      step: a checkpoint of the work directory; an export has one.
      config: the config to build the model with (default: the run's or the export's).

    Raises:
      ConfigError: a run of another model family, a step of an export, or more than
        one process.
      CheckpointError: no such checkpoint, or it cannot be read.
      UserError: ``path`` is neither a work directory nor an export.
    """
    if jax.process_count() > 1:
        raise ConfigError("a trained model is used in one process (of any number of devices)")
    directory = storage.path(path)
    export = is_export(directory)
    if export and step is not None:
        raise ConfigError(f"{directory} is an export, of one step: it takes no step")
    config = read_config(directory) if config is None else config
    require_family(config, family)
    model = experiment_lib.build_model(config, with_data=False)
    with console.phase(f"reading the parameters of {directory}"):
        if export:
            params = ocp.StandardCheckpointer().restore(directory, model.abstract_params)
        else:
            step, variables = evaluation.restore_variables(model, directory, step)
            params = variables["params"]
    return Trained(config, model, params, step, directory)


# What a family's runs are, and what only they do.
_FAMILIES = {
    "transformer": (
        "a translation model",
        "a Transformer run (configs/transformer_*.py) translates",
    ),
    "decoder": ("a language model", "a decoder run (configs/llama.py) generates text"),
}


def require_family(config: ml_collections.ConfigDict, family: str) -> None:
    """Raises ConfigError unless ``config`` is a run of model family ``family``."""
    if config.model.name != family:
        what, only = _FAMILIES.get(family, (f"a {family} model", f"a {family} run does this"))
        raise ConfigError(
            f"this is a run of model.name='{config.model.name}', not {what}: only {only}"
        )


def texts(values: Sequence[str], what: str) -> list[str]:
    """``values`` as a list of strings, checked: a list (or tuple) of ``str``.

    Raises:
      UserError: one string where a list is expected (it would be taken a character
        at a time), or an item that is not a string (None, bytes, a number).
    """
    if isinstance(values, str | bytes):
        raise UserError(f"{what}: give a list of strings, not one {type(values).__name__}")
    try:
        items = list(values)
    except TypeError:
        raise UserError(f"{what}: give a list of strings, not {type(values).__name__}") from None
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise UserError(f"{what}[{i}] is {type(item).__name__} {item!r:.40}, not a string")
    return items
