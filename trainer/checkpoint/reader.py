"""Reading a run's checkpoints without touching them, and the layout they share.

``DIR/checkpoints/<step>/`` holds three items: ``state`` (the train state in its
logical shapes, :meth:`trainer.parallel.plan.UpdateShardingPlan.train_state_to_logical`),
``data`` (the input position, :mod:`trainer.checkpoint.position`) and ``config``.
:class:`CheckpointReader` lists and reads them for every command that only reads a
run; the run itself writes through :class:`trainer.checkpoint.checkpointer.Checkpointer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import orbax.checkpoint as ocp
from etils import epath

from trainer import errors
from trainer.checkpoint import orbax_output
from trainer.checkpoint import position as position_lib
from trainer.checkpoint import tree as tree_lib
from trainer.workdir import run_config, storage


class CheckpointError(errors.UserError):
    """Checkpoints exist but none can be used, or one cannot be written."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's shapes or optimizer state do not fit the configured run."""


class SaveFailedError(CheckpointError):
    """A checkpoint could not be written (disk full, permissions, the object store)."""

    last_words = True


def has_checkpoints(workdir: str | epath.PathLike) -> bool:
    """Whether ``workdir`` has a checkpoints folder."""
    return (storage.path(workdir) / "checkpoints").is_dir()


def state_handler() -> ocp.PyTreeCheckpointHandler:
    """The handler of a checkpoint's train state: Orbax's PyTree format (what its
    ``StandardCheckpointHandler`` writes too), without replica-parallel saving. That
    splits each replicated array among its replicas with a jitted slice of its own,
    compiled at a process's first save: 48 compiles, 9 s of the 12 s first save of the
    ``:tiny`` decoder on 2 cores, more at every step of a model with hundreds of arrays.
    Update sharding leaves the large tensors sharded, written once each anyway."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False))
    )
    return ocp.PyTreeCheckpointHandler(type_handler_registry=registry)


def open_manager(
    directory: epath.Path, *, keep: int | None, async_save: bool, read_only: bool
) -> ocp.CheckpointManager:
    """Orbax's manager of ``directory``: read-only for readers; a writer removes what
    saves cut short left, so only the run holding the work-directory lock opens one."""
    with orbax_output.probing():  # the manager reads the metadata of every step
        return ocp.CheckpointManager(
            directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                save_interval_steps=0 if read_only else 1,  # Orbax warns if it must set it
                enable_async_checkpointing=async_save,
                create=not read_only,
                read_only=read_only,
                # Leftovers of saves cut short: only the run holding the work
                # directory lock writes, so none of them is being written.
                cleanup_tmp_directories=not read_only,
            ),
            item_handlers={
                "state": state_handler(),
                "data": position_lib.DataStateHandler(),
                "config": ocp.JsonCheckpointHandler(filename=run_config.CHECKPOINT_CONFIG_FILE),
            },
        )


class CheckpointReader:
    """The complete checkpoints of a run directory, for reading only.

    Creates, deletes and moves nothing under ``checkpoints/`` (Orbax's read-only
    manager), so it may be opened while the run trains: a writing manager would
    remove the temporary directory of the run's save in flight as a leftover.
    Every command that only reads a run (evaluate, translate, export,
    ``init_from``) uses this; only the run holding the work-directory lock opens
    a :class:`Checkpointer`.

    Args:
      workdir: the run directory (a local path or a URL such as ``gs://b/run``).

    Raises:
      CheckpointError: if ``workdir`` has no checkpoints.
    """

    def __init__(self, workdir: str | epath.PathLike):
        self.directory = storage.path(workdir) / "checkpoints"
        if not self.directory.is_dir():
            raise CheckpointError(f"no checkpoints in {storage.path(workdir)}")
        self._manager = open_manager(self.directory, keep=None, async_save=False, read_only=True)

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        with orbax_output.probing():  # the manager reads the metadata of every step
            self._manager.reload()  # the run may have written since
            return sorted(self._manager.all_steps())

    def newest(self, *, listed: bool = True) -> int | None:
        """The step of the newest complete checkpoint, if any; ``listed=False`` answers
        without I/O, from what this process knows (for a thread not to race the main one)."""
        return max(self.steps() if listed else self._manager.all_steps(), default=None)

    def resolve_step(self, step: int | None = None) -> int:
        """``step``, or the newest complete checkpoint's if None.

        Raises:
          CheckpointError: if there is no such checkpoint.
        """
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no complete checkpoint in {self.directory}")
        if step is None:
            return steps[-1]
        if step not in steps:
            raise CheckpointError(
                f"no checkpoint of step {step} in {self.directory}; there are {steps}"
            )
        return step

    @contextlib.contextmanager
    def _reading(self, step: int) -> Iterator[None]:
        """Any failure to read ``step`` (but a mismatch) as one CheckpointError naming it;
        Orbax's own warnings about the broken parts unsaid."""
        try:
            with orbax_output.probing():
                yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001  (any unreadable part of it)
            raise CheckpointError(
                f"checkpoint {step} in {self.directory} is unreadable ({orbax_output.one_line(e)})"
            ) from None

    def state_metadata(self, step: int) -> dict:
        """Shapes and dtypes of the saved train state of ``step`` (logical shapes);
        CheckpointError if it cannot be read."""
        with self._reading(step):
            metadata = self._manager.item_metadata(step)
            if metadata is None or "state" not in metadata or metadata["state"] is None:
                raise ValueError("its state has no metadata (an empty or cut step directory?)")
            return tree_lib.shapes(metadata["state"])

    def restore_state_parts(self, step: int, target: dict, *, partial: bool = False) -> dict:
        """Reads only some entries of the train state of ``step`` (e.g. ``params`` and
        ``model_state``, not the optimizer state) into ``target``'s shardings; see
        :func:`trainer.checkpoint.tree.restore_tree`. ``partial``: some leaves of an
        entry too (one parameter), the others not read.

        Raises:
          CheckpointMismatchError: naming the first leaf whose shape differs.
          CheckpointError: if it cannot be read.
        """
        saved = {k: v for k, v in self.state_metadata(step).items() if k in target}
        mismatch = tree_lib.first_mismatch(target, saved, partial=partial)
        if mismatch:
            raise CheckpointMismatchError(
                f"checkpoint {step} in {self.directory} does not fit this config: {mismatch[1]}"
            )
        with self._reading(step):
            return tree_lib.restore_tree(self.directory / str(step) / "state", target)

    def close(self) -> None:
        """Releases the manager."""
        self._manager.close()
