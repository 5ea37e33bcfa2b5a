"""A trained model's parameters and config, from a run's work directory, an export or a
Hugging Face model directory.

Every use of a trained model starts here: the :class:`~trainer.inference.translator.Translator`,
the :class:`~trainer.inference.generator.Generator`, evaluation and the exports read the
parameters of one checkpoint (the optimizer state is not read), of an export
(``python -m trainer.export``, which keeps the run's config and tokenizer beside the
parameters) or of a Hugging Face model (``config.json``, safetensors and tokenizer
files: ``--format hf``'s exports too, built as ``configs/llama.py:hf=DIR`` builds them),
placed on this process's devices. The path is an ``epath`` from here on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from trainer import console
from trainer.errors import ConfigError, UserError
from trainer.hf import checkpoint as hf_checkpoint
from trainer.hf import config as hf_config
from trainer.parallel import plan as plan_lib
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
      step: the training step of the parameters (None for an export or a Hugging
        Face model).
      source: where they came from: a work directory, an export or a Hugging Face model.
    """

    config: ml_collections.ConfigDict
    model: experiment_lib.Model
    params: Any
    step: int | None
    source: epath.Path


def is_export(directory: epath.Path) -> bool:
    """Whether ``directory`` is an export (parameters and config), not a work directory."""
    return (directory / _ORBAX_MARKER).exists() and (directory / run_config.FILE).exists()


def is_hugging_face(directory: epath.Path) -> bool:
    """Whether ``directory`` is a Hugging Face model directory (``config.json`` naming
    its ``architectures``: one saved by ``transformers``, or by ``--format hf``)."""
    return hf_config.is_model_directory(directory)


def read_config(directory: epath.Path) -> ml_collections.ConfigDict:
    """The config of a work directory, an export or a Hugging Face model directory.

    Raises:
      UserError: ``directory`` is none of them (a file, say), or its config is damaged.
    """
    if directory.exists() and not directory.is_dir():
        raise UserError(
            f"{directory} is a file: give a run's work directory, an export or a Hugging "
            "Face model directory"
        )
    if is_hugging_face(directory):
        return hf_config.run_config(directory)
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
      path: a work directory, an export (a local path or a URL) or a Hugging Face
        model directory.
      family: the ``model.name`` the caller runs (``transformer``, ``decoder``, ...).
      step: a checkpoint of the work directory; an export has one.
      config: the config to build the model with (default: the run's or the export's).

    Raises:
      ConfigError: a run of another model family, a step of an export, or more than
        one process.
      CheckpointError: no such checkpoint, or it cannot be read.
      UserError: ``path`` is none of these, or ``step`` is not an int.
    """
    if jax.process_count() > 1:
        raise ConfigError("a trained model is used in one process (of any number of devices)")
    directory = storage.path(path)
    check_step(step)
    config = read_config(directory) if config is None else config
    hugging_face = is_hugging_face(directory)
    export = not hugging_face and is_export(directory)
    if (export or hugging_face) and step is not None:
        what = "an export" if export else "a Hugging Face model"
        raise ConfigError(f"{directory} is {what}, of one step: it takes no step")
    require_family(config, family)
    model = experiment_lib.build_model(config, with_data=False)
    with console.phase(f"reading the parameters of {directory}"), _without_orbax_warnings():
        if hugging_face:
            params = hugging_face_params(model, directory)
        elif export:
            params = ocp.StandardCheckpointer().restore(directory, model.abstract_params)
        else:
            step, variables = evaluation.restore_variables(model, directory, step)
            params = variables["params"]
    return Trained(config, model, params, step, directory)


@contextlib.contextmanager
def _without_orbax_warnings() -> Iterator[None]:
    """Orbax warns through absl's logger, on every read, that a checkpoint directory is
    read-only (a reader's normal case): said to the user of the Python API, it reads
    like a problem. Only those records are dropped, by a filter of this block's own
    (the logger's level, which other threads' records pass, is left as it is)."""
    absl = logging.getLogger("absl")
    quiet = _ReadOnlyFilter()
    absl.addFilter(quiet)
    try:
        yield
    finally:
        absl.removeFilter(quiet)


class _ReadOnlyFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "read only" not in record.getMessage()


def check_step(step) -> None:
    """Raises UserError unless ``step`` is None or an int (``"4"`` would be looked for
    as a step of that name, and not found among the steps 4 the message lists)."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise UserError(
            f"step={step!r} is {type(step).__name__}: give a checkpoint's step as an int"
        )


def hugging_face_params(model: experiment_lib.Model, directory: epath.Path):
    """The parameters of the Hugging Face model in ``directory``, in their logical
    shapes and ``model``'s shardings, read a tensor at a time (:mod:`trainer.hf.checkpoint`).

    Raises:
      ConfigError: a shard missing or cut short, a tensor missing or of another
        shape or dtype than ``config.json`` gives it.
    """
    specs = jax.tree.map(lambda p: p.sharding.spec, model.abstract_params)
    # ``none`` stores each parameter as it is: its logical shape, sharded over model axes.
    plan = plan_lib.make_plan(
        model.abstract_params, specs, model.mesh, mode="none", stacks=model.layer_stacks
    )
    imported = hf_checkpoint.load(directory, plan, model.abstract_params, model.config.model)
    with jax.set_mesh(model.mesh):
        return plan.to_logical(traverse_util.unflatten_dict(imported.params, sep="/"))


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
        at a time), a file (its lines would end in newlines), or an item that is not
        a string (None, bytes, a number).
    """
    if isinstance(values, str | bytes):
        raise UserError(f"{what}: give a list of strings, not one {type(values).__name__}")
    if isinstance(values, io.IOBase):  # its lines would keep their newlines
        raise UserError(f"{what}: give a list of strings, not a file (f.read().splitlines())")
    try:
        items = list(values)
    except TypeError:
        raise UserError(f"{what}: give a list of strings, not {type(values).__name__}") from None
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise UserError(f"{what}[{i}] is {type(item).__name__} {item!r:.40}, not a string")
    return items
