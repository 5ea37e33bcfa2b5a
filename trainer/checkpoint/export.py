"""Exporting a checkpoint's parameters as a plain Orbax checkpoint: a nested dict
of arrays that loads without this project's classes::

    import orbax.checkpoint as ocp
    params = ocp.StandardCheckpointer().restore("PATH")

Only the ``params`` subtree is read (partial restore), not the optimizer state.
Beside the parameters the export keeps the run's ``config.json`` (with the layer
layout it was written in) and, for a translation run, its ``vocab.model``: what
``trainer.Translator.load(PATH)`` needs to decode without the run's directory.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import traverse_util

from models import stacking
from trainer import tasks
from trainer.checkpoint.reader import CheckpointError, CheckpointReader
from trainer.errors import ConfigError
from trainer.input.translation import VOCAB_FILE
from trainer.workdir import run_config, storage


def export(
    workdir: str,
    out: str,
    *,
    step: int | None = None,
    dtype: str = "float32",
    scan_layers: bool | None = None,
) -> int:
    """Exports the params of checkpoint ``step`` (default latest); returns the step.

    Args:
      scan_layers: write the layers as stacks (True: ``encoder_layers/...`` leaves of
        ``[layers, ...]``) or one module per layer (False), whichever way the run was
        trained (:mod:`models.stacking`); None: as trained.

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
      ConfigError: ``out`` exists, ``workdir`` is not a directory, or the model has
        no layer stacks to convert.
    """
    destination = storage.path(out)
    if destination.exists():
        raise ConfigError(f"--out {destination} already exists: choose a new path or remove it")
    directory = storage.workdir(workdir)
    checkpoints = CheckpointReader(directory)
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
    params = restored["params"]
    config = run_config.load(str(directory))
    if scan_layers is not None:
        params = _relayout(params, config, scan_layers)  # and sets model.scan_layers
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
    saver = ocp.StandardCheckpointer()
    saver.save(destination, params)
    saver.wait_until_finished()
    storage.write_atomically(destination / run_config.FILE, config.to_json_best_effort(indent=2))
    vocab = directory / VOCAB_FILE
    if vocab.exists():
        storage.write_atomically(destination / VOCAB_FILE, vocab.read_bytes())
    return step


def _relayout(params: dict, config, scan_layers: bool) -> dict:
    """``params`` in the layer layout of ``config``'s model with ``scan_layers`` (which it
    sets in ``config``)."""
    if "scan_layers" not in config.model:
        raise ConfigError(
            f"--scan_layers: model.name='{config.model.name}' has no layer stacks to convert"
        )
    config.model.scan_layers = scan_layers
    task = tasks.make_task(config, process_index=0, process_count=1, with_data=False)
    shapes = jax.eval_shape(task.init_fn, jax.random.PRNGKey(0), task.init_batch)
    wanted = traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")
    have = traverse_util.flatten_dict(params, sep="/")
    sources = stacking.match(wanted, have)
    if missing := sorted(set(wanted) - set(sources)):
        raise ConfigError(f"--scan_layers: the checkpoint has no {', '.join(missing[:5])}")
    return traverse_util.unflatten_dict(stacking.assemble(sources, have), sep="/")
