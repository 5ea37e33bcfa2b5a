"""Exporting a checkpoint's parameters as a plain Orbax checkpoint: a nested dict
of arrays that loads without this project's classes::

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore("PATH")

Only the ``params`` subtree is read (partial restore), not the optimizer state.
Beside the parameters the export keeps the run's ``config.json`` (with the layer
layout it was written in) and the run's files its task keeps (a translation run's
``vocab.model``, a language model's tokenizer): what
``trainer.Translator.load(PATH)`` and ``trainer.Generator.load(PATH)`` need without
the run's directory. ``--format hf`` writes a Hugging Face model directory instead
(:mod:`trainer.inference.hf_export`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from models import stacking
from trainer import tasks
from trainer.checkpoint.reader import CheckpointError, CheckpointReader
from trainer.errors import ConfigError
from trainer.workdir import run_config, storage


def check_destination(out: str | epath.PathLike) -> epath.Path:
    """``out`` as a path, if nothing is there yet (or an empty directory).

    Raises:
      ConfigError: ``out`` exists and is not an empty directory.
    """
    destination = storage.path(out)
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ConfigError(
            f"--out {destination} already exists and is not empty: choose a new path or remove it"
        )
    return destination


def read_params(
    workdir: epath.Path, step: int | None = None
) -> tuple[int, dict, ml_collections.ConfigDict]:
    """``(step, params, config)`` of checkpoint ``step`` (default the newest) of
    ``workdir``: the parameters in their logical shapes, on this host's first device.

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
    """
    checkpoints = CheckpointReader(workdir)
    step = checkpoints.resolve_step(step)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    try:
        saved = checkpoints.state_metadata(step)["params"]
        target = jax.tree.map(
            lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), saved
        )
        restored = checkpoints.restore_state_parts(step, {"params": target})
    except CheckpointError as e:
        others = [s for s in checkpoints.steps() if s != step]
        raise CheckpointError(f"{e}; export another with --step (there are {others})") from None
    finally:
        checkpoints.close()
    return step, restored["params"], run_config.load(workdir)


def export(
    workdir: str | epath.PathLike,
    out: str | epath.PathLike,
    *,
    step: int | None = None,
    dtype: str = "float32",
    scan_layers: bool | None = None,
) -> tuple[int, ml_collections.ConfigDict]:
    """Exports the params of checkpoint ``step`` (default latest).

    Args:
      scan_layers: write the layers as stacks (True: ``encoder_layers/...`` leaves of
        ``[layers, ...]``) or one module per layer (False), whichever way the run was
        trained (:mod:`models.stacking`); None: as trained.

    Returns:
      ``(step, config)``: the checkpoint's step and the config written beside the
      parameters (the run's, with ``model.scan_layers`` as written).

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
      ConfigError: ``out`` exists, ``workdir`` is not a directory, or the model has
        no layer stacks to convert.
    """
    destination = check_destination(out)
    directory = storage.workdir(workdir)
    step, params, config = read_params(directory, step)
    if scan_layers is not None:
        params, config = relayout(params, config, scan_layers)
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
    saver = ocp.StandardCheckpointer()
    saver.save(destination, params, force=True)
    saver.wait_until_finished()
    storage.write_atomically(destination / run_config.FILE, config.to_json_best_effort(indent=2))
    copy_run_files(directory, destination, config)
    return step, config


def copy_run_files(directory: epath.Path, destination: epath.Path, config) -> None:
    """Copies the files the run keeps for later use (its tokenizer) into ``destination``."""
    for name in tasks.run_file_names(config):
        if (kept := directory / name).exists():
            storage.write_atomically(destination / name, kept.read_bytes())


def relayout(
    params: dict[str, Any], config: ml_collections.ConfigDict, scan_layers: bool
) -> tuple[dict[str, Any], ml_collections.ConfigDict]:
    """``params`` in the layer layout of ``config``'s model with ``scan_layers``, and
    that config (a copy: ``config`` is left as it is)."""
    if "scan_layers" not in config.model:
        raise ConfigError(
            f"--scan_layers: model.name='{config.model.name}' has no layer stacks to convert"
        )
    config = config.copy_and_resolve_references()
    config.model.scan_layers = scan_layers
    task = tasks.make_task(config, process_index=0, process_count=1, with_data=False)
    shapes = jax.eval_shape(task.init_fn, jax.random.PRNGKey(0), task.init_batch)
    wanted = traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")
    have = traverse_util.flatten_dict(params, sep="/")
    sources = stacking.match(wanted, have)
    if missing := sorted(set(wanted) - set(sources)):
        raise ConfigError(f"--scan_layers: the checkpoint has no {', '.join(missing[:5])}")
    return traverse_util.unflatten_dict(stacking.assemble(sources, have), sep="/"), config
