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

import contextlib
import os
import shutil
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import orbax.checkpoint as ocp
from etils import epath
from flax import traverse_util

from models import stacking
from trainer import faults, tasks
from trainer.checkpoint.reader import CheckpointError, CheckpointReader
from trainer.errors import ConfigError
from trainer.inference import loading
from trainer.workdir import run_config, storage


def check_destination(out: str | epath.PathLike, workdir: epath.Path | None = None) -> epath.Path:
    """``out`` as a path, if nothing is there yet (or an empty directory) and it is not
    inside ``workdir``'s checkpoints (which the run's checkpoint manager owns: its
    cleanup would delete an export there, or take it for a checkpoint).

    Raises:
      ConfigError: ``out`` exists and is not an empty directory, or lies in the
        checkpoints directory.
    """
    destination = storage.path(out)
    if workdir is not None:
        checkpoints = storage.path(workdir) / "checkpoints"
        if destination == checkpoints or checkpoints in destination.parents:
            raise ConfigError(
                f"--out {destination} is inside the run's checkpoints directory {checkpoints}, "
                "which the run manages (it deletes what it does not keep): write the export "
                "elsewhere"
            )
    if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
        raise ConfigError(
            f"--out {destination} already exists and is not empty: choose a new path or remove it"
        )
    return destination


@contextlib.contextmanager
def staging(destination: epath.Path) -> Iterator[epath.Path]:
    """A directory to write an export into, renamed ``destination`` when the block
    ends without an error, removed with all it holds when it raises: a failed export
    (a full disk, a refusal, Ctrl-C) leaves nothing at ``destination``. An object
    store has no rename of directories: there the export is written in place (its
    ``config.json`` last: without it, a directory is not taken for an export).

    Raises:
      PathError: a file-system error of the destination (a full disk, permissions),
        naming it.
    """
    if storage.is_remote(destination):
        yield destination
        return
    partial = destination.parent / f".{destination.name}.partial-{os.getpid()}"
    try:
        storage.make_directory(destination.parent, "--out")
        if partial.exists():
            shutil.rmtree(partial)
        partial.mkdir()
        yield partial
        if destination.exists():
            destination.rmdir()  # empty (check_destination): replaced by the export
        os.replace(partial, destination)
    except OSError as e:
        shutil.rmtree(partial, ignore_errors=True)
        if e.errno not in storage.PATH_ERRNOS:
            raise
        if not e.filename or str(partial) in str(e.filename):  # the export's own write
            raise storage.PathError(
                f"--out {storage.explain(e, destination)} (nothing was left there)"
            ) from None
        raise storage.PathError(storage.explain(e)) from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


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
    """Exports the params of checkpoint ``step`` (default latest), or of the Hugging
    Face model directory ``workdir``, into a directory renamed ``out`` at the end
    (:func:`staging`).

    Args:
      scan_layers: write the layers as stacks (True: ``encoder_layers/...`` leaves of
        ``[layers, ...]``) or one module per layer (False), whichever way the run was
        trained (:mod:`models.stacking`); None: as trained.

    Returns:
      ``(step, config)``: the checkpoint's step (None from a Hugging Face model
      directory: its config is ``configs/llama.py:hf=DIR``) and the config written
      beside the parameters (the run's, with ``model.scan_layers`` as written).

    Raises:
      CheckpointError: no such checkpoint, or it cannot be read.
      ConfigError: ``out`` exists, ``workdir`` is not a directory, or the model has
        no layer stacks to convert.
    """
    destination = check_destination(out, workdir)
    if loading.is_hugging_face(storage.path(workdir)):
        directory = storage.path(workdir)
        trained = loading.load(directory, family="decoder", step=step)
        step, params, config = None, trained.params, trained.config
    else:
        directory = storage.workdir(workdir)
        step, params, config = read_params(directory, step)
    if scan_layers is not None:
        params, config = relayout(params, config, scan_layers)
    params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), params)
    with staging(destination) as partial:
        save(partial, params, config, {n: (directory / n) for n in tasks.run_file_names(config)})
    return step, config


def save(
    destination: epath.Path,
    params: Any,
    config: ml_collections.ConfigDict,
    run_files: dict[str, epath.Path],
) -> None:
    """Writes an export: ``params`` as a plain Orbax checkpoint, then the run files
    that exist (name -> where they are) and ``config.json`` last."""
    saver = ocp.StandardCheckpointer()
    saver.save(destination, params, force=True)
    saver.wait_until_finished()
    faults.point("export")
    for name, kept in run_files.items():
        if kept.exists():
            storage.write_atomically(destination / name, kept.read_bytes())
    storage.write_atomically(destination / run_config.FILE, config.to_json_best_effort(indent=2))


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
