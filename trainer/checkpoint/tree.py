"""An Orbax PyTree checkpoint read by shape: its metadata, a partial restore, a comparison.

The directory is given: a checkpoint's ``state`` item (which
:class:`trainer.checkpoint.checkpointer.Checkpointer`, the owner of the run's layout, names) or
a ``trainer.export``. Reads go straight into the target's shardings and dtypes,
never through one host.
"""

from __future__ import annotations

from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from trainer.parallel.rules import param_name
from trainer.workdir import storage


def first_mismatch(
    abstract: Any, metadata: Any, *, partial: bool = False
) -> tuple[str, str] | None:
    """The first leaf (parameters first) whose saved shape differs from the target's,
    or that only one of them has.

    Args:
      abstract: the target tree (leaves with a ``shape``).
      metadata: the saved tree's metadata (leaves with a ``shape``).
      partial: the target is some of the saved leaves: leaves it lacks are fine.

    Returns:
      ``(leaf path, what differs)``, or None if every shape fits.
    """
    # Metadata comes back as nested dicts where the state had NamedTuples: compare
    # paths by their names only.
    saved = {param_name(p): m for p, m in jax.tree_util.tree_leaves_with_path(metadata)}
    wanted = {param_name(p): leaf for p, leaf in jax.tree_util.tree_leaves_with_path(abstract)}
    for key in sorted(wanted, key=lambda k: not k.startswith("params/")):
        if key not in saved:
            return key, f"{key} is not in the checkpoint"
        shape = tuple(getattr(saved[key], "shape", ()) or ())
        if shape != tuple(wanted[key].shape):
            return key, (
                f"{key} has shape {shape} in the checkpoint but {tuple(wanted[key].shape)} here"
            )
    extra = [] if partial else sorted(set(saved) - set(wanted))
    return (extra[0], f"the checkpoint has {extra[0]}, which this run does not") if extra else None


def shapes(metadata: Any) -> Any:
    """``metadata`` (Orbax's array metadata leaves) as ``jax.ShapeDtypeStruct`` leaves."""
    return jax.tree.map(lambda m: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype), metadata)


def tree_metadata(directory: str | epath.PathLike) -> Any:
    """Shapes and dtypes (``jax.ShapeDtypeStruct`` leaves) of the Orbax PyTree
    checkpoint in ``directory`` (a ``state`` item, or a ``trainer.export``)."""
    path = storage.path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"no directory {path}")
    metadata = ocp.PyTreeCheckpointer().metadata(path).item_metadata
    if metadata is None:
        raise ValueError(f"{path} is not an Orbax checkpoint")
    return shapes(metadata.tree)


def restore_tree(directory: str | epath.PathLike, target: dict) -> dict:
    """Reads only the leaves of ``target`` from the Orbax PyTree checkpoint in
    ``directory``, straight into their shardings and dtypes.

    Args:
      directory: the checkpoint (a ``state`` item, or a ``trainer.export``).
      target: a nested dict, a subset of the saved tree, of ``jax.ShapeDtypeStruct``
        with shardings.
    """
    kept = {k: v for k, v in target.items() if jax.tree.leaves(v)}  # orbax refuses empty ones
    restored = ocp.PyTreeCheckpointer().restore(
        storage.path(directory),
        args=ocp.args.PyTreeRestore(
            item=kept,
            restore_args=ocp.checkpoint_utils.construct_restore_args(kept),
            partial_restore=True,
        ),
    )
    return {k: restored[k] if k in kept else v for k, v in target.items()}
