"""The run's checkpoints: saved asynchronously, restored on any mesh or mode, and
every fault on the way.

The layout (``DIR/checkpoints/<step>/``: ``state``, ``data``, ``config``) is
:mod:`trainer.checkpoint.reader`'s. The ``state`` is the train state in its
*logical* shapes (the update-sharding padding dropped), written shard by shard by
the hosts that own them and read straight into the target's shardings, never
through one host: any mesh and any ``update_sharding`` mode can restore it.

Orbax writes into ``<step>.orbax-checkpoint-tmp`` and renames it when every host
has finished, so a save cut short is never listed; the next run (holding the
work-directory lock, so no other run can be writing) removes such leftovers.

Faults, and what a run does about them:

* a checkpoint that cannot be read, in any part (arrays, metadata, input
  position, config; an empty step directory), is moved to
  ``checkpoints/corrupt/<step>-<time>`` with a warning, and the previous one is
  used: the next save of that step does not collide with it;
* a checkpoint holding NaN or Inf (saved before saves were checked) is moved
  aside the same way; a state that is not finite is never saved
  (:class:`NonFiniteStateError`);
* a checkpoint of another model or optimizer is an error naming the difference,
  never "unreadable";
* a background save that fails (a full disk) is found at the next loop
  boundary (:meth:`Checkpointer.failure`) and ends the run with one line, its
  temporary directory removed (it may hold what little space is left);
* retention (``keep_checkpoints`` >= 1) deletes old checkpoints only after a
  newer one is complete, so the newest complete checkpoint is never deleted.

What Orbax prints itself about these faults is dropped
(:mod:`trainer.checkpoint.orbax_output`, which the commands install).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from trainer import console, errors
from trainer.checkpoint import leftovers as leftovers_lib
from trainer.checkpoint import orbax_output
from trainer.checkpoint import position as position_lib
from trainer.checkpoint import tree as tree_lib
from trainer.checkpoint.reader import (
    CheckpointMismatchError,
    CheckpointReader,
    SaveFailedError,
    open_manager,
)
from trainer.parallel import rules
from trainer.workdir import storage

CORRUPT = "corrupt"  # unreadable checkpoints are moved into this subdirectory


class NonFiniteStateError(errors.UserError):
    """The train state to be saved holds NaN or Inf values; nothing was saved."""


def _unreadable(problem: BaseException | None) -> str:
    if problem is None:
        return "is unreadable on another process"
    return f"is unreadable ({orbax_output.one_line(problem)})"


def all_processes(ok: bool) -> bool:
    """Whether ``ok`` holds on every process (every process must call this)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.array(ok))))


@jax.jit
def _all_finite(leaves: list[jax.Array]) -> jax.Array:
    # Per leaf, on its shards: a local reduction and a one-element all-reduce.
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])


def first_nonfinite(tree: Any) -> str | None:
    """The path of the first floating-point leaf of ``tree`` holding a NaN or an Inf
    (``"params/encoder/.../kernel"``), or None. Nothing is gathered: each leaf is
    checked where its shards are. Every process must call this."""
    named = [
        (rules.param_name(path), x)
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
        if jnp.issubdtype(x.dtype, jnp.inexact)
    ]
    if not named:
        return None
    finite = np.asarray(jax.device_get(_all_finite([x for _, x in named])))
    return next((name for (name, _), ok in zip(named, finite, strict=True) if not ok), None)


class Checkpointer(CheckpointReader):
    """Saves and restores the train states of the run that holds ``workdir``'s lock.

    Opening it removes what saves cut short left (Orbax's temporary directories),
    so only the lock holder may: see :class:`CheckpointReader` for everyone else.

    Args:
      workdir: the run directory (a local path or a URL such as ``gs://b/run``).
      keep: how many of the latest complete checkpoints to keep (>= 1).
      async_save: write in the background while training continues.
    """

    def __init__(self, workdir: str | epath.PathLike, *, keep: int, async_save: bool = True):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = storage.path(workdir) / "checkpoints"
        if self.directory.exists() and not self.directory.is_dir():
            raise errors.UserError(
                f"{self.directory} is a file, where the run keeps its checkpoints: move it "
                "away (or choose another --workdir)"
            )
        self._pending: int | None = None  # the step of the save in flight
        self._failure: str | None = None  # why the last save failed, once known
        self.abandoned: int | None = None  # the step of a save given up (Orbax lists it)
        self.moved_aside: list[int] = []  # steps moved to corrupt/ by this process's restore
        self._manager = open_manager(
            self.directory, keep=keep, async_save=async_save, read_only=False
        )

    @property
    def pending(self) -> int | None:
        """The step of the save in flight (None: none)."""
        return self._pending

    def newest(self, *, listed: bool = True) -> int | None:
        """As :meth:`CheckpointReader.newest`, without a save this process abandoned."""
        steps = self.steps() if listed else self._manager.all_steps()
        return max((s for s in steps if s != self.abandoned), default=None)

    def save(self, step: int, logical_state, data_state, config: ml_collections.ConfigDict):
        """Starts saving (returns before the write finishes if async).

        Raises:
          NonFiniteStateError: if the state holds a NaN or an Inf (nothing is saved:
            a resumed run would fail on it again and again).
          SaveFailedError: if the previous save failed.
        """
        bad = first_nonfinite(logical_state)
        if bad is not None:
            raise NonFiniteStateError(
                f"the train state after step {step} is not finite ({bad} holds NaN or Inf "
                "values); nothing was saved: lower the learning rate or check the data"
            )
        self.wait()
        self._pending = step
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.PyTreeSave(logical_state._asdict()),
                data=position_lib.DataStateSave(data_state),
                config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())),
            ),
            force=True,
        )

    def failure(self) -> str | None:
        """Why the save in flight failed, if it has finished and failed; never blocks."""
        done = self._pending is not None and not self._manager.is_saving_in_progress()
        if self._failure is None and done:
            with contextlib.suppress(SaveFailedError):
                self.wait()
        return self._failure

    def wait(self) -> None:
        """Blocks until the save in flight is complete.

        Raises:
          SaveFailedError: if it failed (its temporary directory is removed).
        """
        if self._failure is not None:
            raise SaveFailedError(self._failure)
        try:
            self._manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001  (any write error of any item)
            step, self._pending = self._pending, None
            self.remove_temporary(step)
            self._failure = (
                f"saving the checkpoint of step {step} in {self.directory} failed: "
                + orbax_output.write_error(e)
            )
            raise SaveFailedError(self._failure) from None
        self._pending = None

    def remove_temporary(self, step: int | None) -> None:
        """Removes what a failed save of ``step`` left unfinished (process 0; None:
        nothing): on a full disk it may hold the last free space. Its writer threads
        may still add files meanwhile (:mod:`trainer.checkpoint.leftovers`)."""
        if step is None or jax.process_index() != 0:
            return
        leftovers_lib.remove_until_quiet(self.directory, f"{step}.orbax-checkpoint-tmp*")

    def abandon(self) -> int | None:
        """Gives up the save in flight without waiting (a peer died, or Ctrl-C
        twice); returns its step. Its writer threads write on until the process
        exits; the next run removes what they left (Orbax's cleanup of temporary
        directories, which only the lock holder's :class:`Checkpointer` does)."""
        step, self._pending = self._pending, None
        if step is None or (self.directory / str(step)).exists():  # it had completed
            return None
        self.abandoned = step
        return step

    def close(self) -> None:
        """Waits for the save in flight and releases the manager.

        Raises:
          SaveFailedError: if that save failed (its temporary directory removed).
        """
        try:
            self.wait()
        finally:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001  (Orbax raises a failed save at every wait)
                if self._failure is None:
                    raise

    def restore(
        self, abstract_logical_state, *, optimizer: str | None = None
    ) -> tuple[int, Any, Any] | None:
        """Restores the newest readable checkpoint into the given abstract state.

        Unreadable checkpoints on the way are moved to ``checkpoints/corrupt/``.

        Args:
          abstract_logical_state: ShapeDtypeStructs (with shardings) to restore into.
          optimizer: this run's ``optimizer.name``, to say so if the checkpoint's
            differs (None: not known, e.g. a reader without the run's config).

        Returns:
          ``(step, logical_state_dict, data_state)``, or None if there are no
          readable checkpoints.

        Raises:
          CheckpointMismatchError: naming the first parameter or optimizer-state
            leaf that differs.
        """
        with orbax_output.probing():
            return self._restore(abstract_logical_state._asdict(), optimizer)

    def _restore(self, target: dict, optimizer: str | None) -> tuple[int, Any, Any] | None:
        steps = self.steps()
        for i, step in reversed(list(enumerate(steps))):
            older = i > 0
            try:
                saved = self._manager.restore(
                    step, args=ocp.args.Composite(config=ocp.args.JsonRestore())
                )["config"]
                mismatch = tree_lib.first_mismatch(
                    target, self._manager.item_metadata(step)["state"]
                )
                problem = None
            except Exception as e:  # noqa: BLE001  (any unreadable part: try an older one)
                mismatch, problem = None, e
            if not all_processes(problem is None):
                self._move_aside(step, _unreadable(problem), older=older)
                continue
            if mismatch:
                key, what = mismatch
                saved_optimizer = saved.get("optimizer", {}).get("name", "?")
                if key.startswith("opt_state/") and optimizer and saved_optimizer != optimizer:
                    what = (
                        f"it was saved with optimizer {saved_optimizer} and this run uses "
                        f"{optimizer}, whose state differs ({what}); resume with "
                        f"--config.optimizer.name={saved_optimizer} or use another --workdir"
                    )
                elif key.startswith("opt_state/"):
                    what = f"its optimizer state differs ({what})"
                raise CheckpointMismatchError(
                    f"checkpoint {step} in {self.directory} does not fit this config: {what}"
                )
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.PyTreeRestore(
                            item=target,
                            restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                        ),
                        data=position_lib.DataStateRestore(),
                    ),
                )
                problem = None
            except Exception as e:  # noqa: BLE001
                problem = e
            if not all_processes(problem is None):
                self._move_aside(step, _unreadable(problem), older=older)
                continue
            # Saved before saves were checked, or written by another program: resuming
            # from it would fail at the first step, every time.
            bad = first_nonfinite(restored["state"])
            if bad is not None:
                why = f"holds non-finite values ({bad} has NaN or Inf)"
                self._move_aside(step, why, older=older)
                continue
            return step, restored["state"], restored["data"]
        return None

    def _move_aside(self, step: int, why: str, *, older: bool) -> None:
        """Moves unusable checkpoint ``step`` into ``corrupt/`` (process 0), so the
        next save of that step finds the name free; ``why`` completes "checkpoint N"."""
        if jax.process_index() == 0:
            corrupt = self.directory / CORRUPT
            corrupt.mkdir(parents=True, exist_ok=True)
            readme = corrupt / "README"
            if not readme.exists():  # also makes the "directory" exist in object stores
                readme.write_text(
                    "Checkpoints the trainer could not use, moved here with the time of the "
                    "move. Inspect or delete them; move one back to retry it.\n"
                )
            destination = corrupt / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
            (self.directory / str(step)).rename(destination)
            then = "trying an older one" if older else "there is no older one"
            console.warn(f"checkpoint {step} {why}; moved it to {destination}; {then}")
        self.moved_aside.append(step)
        all_processes(True)  # the others wait for the move
        self._manager.reload()
