"""Flags of the commands that work on a finished run (``trainer.evaluate``,
``trainer.translate``, ``trainer.generate``): ``--config`` is the config of the run
``--workdir`` names (:mod:`trainer.workdir.run_config`), or of the Hugging Face model
directory it names (``configs/llama.py:hf=DIR``), which ``--config.a.b=value``
overrides with the trainer's own syntax and types, e.g. another mesh or
``--config.eval_beam_size=4``.
"""

from __future__ import annotations

from typing import Any

import ml_collections
from absl import flags
from ml_collections import config_flags

from trainer.command import cli
from trainer.errors import UserError
from trainer.hf import config as hf_config
from trainer.workdir import run_config, storage


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
        config = workdir_config(workdir)
    except FileNotFoundError:
        cli.fail(f"no config.json in {workdir}: not a run directory of python -m trainer")
    except UserError as e:
        cli.fail(str(e))
    except OSError as e:
        cli.fail(f"--workdir {storage.explain(e)}")
    cli.check_keys(config, cli.config_overrides(argv))
    argv = cli.comma_lists(config, argv)
    config_flags.DEFINE_config_dict("config", config, "The run's config.", sys_argv=argv)
    return cli.parse_flags(argv)


def workdir_config(workdir: str, *, warn: bool = True) -> ml_collections.ConfigDict:
    """The config of the run in ``workdir``, or of the Hugging Face model there.

    Raises:
      FileNotFoundError: no ``config.json`` there.
      UserError: a damaged one, or a model's field that cannot be mapped.
    """
    if hf_config.is_model_directory(workdir):
        return hf_config.run_config(workdir)
    return run_config.load(workdir, warn=warn)


def overrides(workdir: str, config: ml_collections.ConfigDict) -> dict[str, Any]:
    """``{"a.b": value}`` where ``config`` differs from the run's own config."""
    before = run_config.flat_config(workdir_config(workdir, warn=False))
    return {k: v for k, v in run_config.flat_config(config).items() if before.get(k) != v}


def config_value() -> ml_collections.ConfigDict:
    """The parsed ``--config`` (after :func:`parse_flags`)."""
    return flags.FLAGS.config
