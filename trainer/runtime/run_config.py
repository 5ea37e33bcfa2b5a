"""The config a run was trained with, read back from ``DIR/config.json``, for the
commands that work on a finished run (``trainer.evaluate``, ``trainer.translate``).

The trainer writes the resolved config as JSON; JSON has no tuples and no typed
``None``, so they come back as the configs declare them: lists as tuples, and
a ``None`` key as an unset string (every such key in ``configs/`` is a path or a
name).
``--config.a.b=value`` then overrides the run's values with the trainer's own
syntax and types, e.g. another mesh or ``--config.eval_beam_size=4``.
"""

from __future__ import annotations

import json
from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from trainer.runtime import cli, storage


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


def from_json(text: str) -> ml_collections.ConfigDict:
    """A config from the JSON ``train`` wrote (``config.to_json_best_effort()``)."""
    return _typed(json.loads(text))


def load(workdir: str) -> ml_collections.ConfigDict:
    """The config of the run in ``workdir``.

    Raises:
      FileNotFoundError: if ``workdir`` holds no ``config.json``.
    """
    return from_json((storage.path(workdir) / "config.json").read_text())


def _flag_value(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing (for ``app.run(flags_parser=...)``) where ``--config`` is the
    config of the run named by ``--workdir``, overridden by ``--config.a.b=value``.

    Mistakes end in one ``error:`` line, as the trainer's do.
    """
    storage.configure()  # config.json may be in a bucket (and its emulator)
    workdir = _flag_value(argv, "workdir")
    if workdir is None:
        cli.fail("--workdir is required (a run directory written by python -m trainer)")
    try:
        config = load(workdir)
    except FileNotFoundError:
        cli.fail(f"no config.json in {workdir}: not a run directory of python -m trainer")
    cli.check_keys(config, cli.config_overrides(argv))
    config_flags.DEFINE_config_dict("config", config, "The run's config.", sys_argv=argv)
    return cli.parse_flags(argv)


def overrides(workdir: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``{"a.b": value}`` where ``config`` differs from the run's own config."""
    before = cli.flat_config(load(workdir))
    return {k: v for k, v in cli.flat_config(config).items() if before.get(k) != v}


def config_value() -> ml_collections.ConfigDict:
    """The parsed ``--config`` (after :func:`parse_flags`)."""
    return flags.FLAGS.config
