"""The config a run was trained with, read back from ``DIR/config.json``, for the
commands that work on a finished run (``trainer.evaluate``, ``trainer.translate``;
their flags: :mod:`trainer.command.run_flags`).

The trainer writes the resolved config as JSON; JSON has no tuples and no typed
``None``, so they come back as the configs declare them: lists as tuples, and
a ``None`` key as an unset string (every such key in ``configs/`` is a path or a
name).
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections

from configs import common
from trainer import console
from trainer.errors import UserError
from trainer.workdir import storage


def _typed(value: Any) -> Any:
    if isinstance(value, dict):
        return ml_collections.ConfigDict(
            {
                k: ml_collections.FieldReference(None, field_type=str) if v is None else _typed(v)
                for k, v in value.items()
            }
        )
    if isinstance(value, list):  # inside tuples, None stays None (e.g. sharding rules)
        return tuple(_typed(v) for v in value)
    return value


# Each checkpoint keeps the config it was saved with, as JSON in this file of its
# ``config`` item (trainer/checkpoint/reader.py names it so for Orbax).
CHECKPOINT_CONFIG_FILE = "metadata"


def from_json(text: str) -> ml_collections.ConfigDict:
    """A config from the JSON ``train`` wrote (``config.to_json_best_effort()``).

    Raises:
      ValueError: if ``text`` is not a JSON object.
    """
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"a JSON {type(value).__name__}, not an object")
    config = _typed(value)
    # A run made before a common key existed (configs/common.py) gets its default, at
    # any depth (optimizer.warmup_ratio in a recorded optimizer section).
    _fill(config, common.base_config())
    return config


def _fill(config: ml_collections.ConfigDict, defaults: ml_collections.ConfigDict) -> None:
    for key in defaults:
        if key not in config:
            config[key] = defaults[key]
        elif isinstance(defaults[key], ml_collections.ConfigDict) and isinstance(
            config[key], ml_collections.ConfigDict
        ):
            _fill(config[key], defaults[key])


def _saved_with_checkpoint(workdir: str) -> tuple[int, ml_collections.ConfigDict] | None:
    """The newest checkpoint's own copy of the config that can be read, and its step."""
    checkpoints = storage.path(workdir) / "checkpoints"
    steps = [p.name for p in checkpoints.iterdir()] if checkpoints.is_dir() else []
    for step in sorted((int(s) for s in steps if s.isdigit()), reverse=True):
        copy = checkpoints / str(step) / "config" / CHECKPOINT_CONFIG_FILE
        try:
            return step, from_json(copy.read_text())
        except (OSError, ValueError):
            continue
    return None


# A run's config, and an export's, as written beside its checkpoints or parameters.
FILE = "config.json"


def load(workdir: str, *, warn: bool = True) -> ml_collections.ConfigDict:
    """The config of the run in ``workdir``: its ``config.json``, or, if that is
    damaged (cut short, not JSON), the copy saved with its newest checkpoint (said
    in a warning unless ``warn`` is False).

    Raises:
      FileNotFoundError: if ``workdir`` holds no ``config.json``.
      UserError: if it is damaged and no checkpoint holds a copy.
    """
    path = storage.path(workdir) / FILE
    text = path.read_bytes()
    try:
        return from_json(text.decode("utf-8"))
    except ValueError as e:  # UnicodeDecodeError and JSONDecodeError included
        problem = f"{type(e).__name__}: {' '.join(str(e).split())}"
    saved = _saved_with_checkpoint(workdir)
    if saved is None:
        raise UserError(
            f"{path} is damaged ({problem}) and no checkpoint keeps a copy: run the training "
            f"command again with --workdir {workdir}, which writes it anew"
        )
    step, config = saved
    if warn:
        console.warn(
            f"{path} is damaged ({problem}): using the config saved with checkpoint {step}; "
            "the next training run in this directory writes the file anew"
        )
    return config


def flat_config(config: ml_collections.ConfigDict) -> dict:
    """``{"a.b": value}``: every leaf of ``config`` under its dotted key (the key of
    ``--config.a.b=value``; the config block, the evaluate overrides, TensorBoard's
    hparams and the checks of the trainer all read a config so)."""

    def walk(tree: dict, prefix: str):
        for key, value in tree.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(config.to_dict(), ""))
