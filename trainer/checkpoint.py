"""Orbax checkpoints: sharded, asynchronous, resumable on another mesh or mode.

``DIR/checkpoints/<step>/`` holds three items:

* ``state``: the train state with params and optimizer state in their *logical*
  shapes (the update-sharding padding dropped), written shard by shard by the
  hosts that own them. Logical shapes make a checkpoint readable by any mesh and
  any ``update_sharding`` mode; a restore reads straight into the target's
  shardings (never everything onto one host).
* ``data``: each process's grain iterator position, one JSON file per process.
* ``config``: the run config.

Orbax writes into a temporary directory and renames it when every host has
finished, so a save killed half-way is never listed as a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp
from etils import epath


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be used."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoint's shapes do not fit the configured model."""


class DataStateHandler(ocp.CheckpointHandler):
    """Saves each process's input-pipeline position as its own JSON file."""

    def _file(self, directory: epath.Path) -> epath.Path:
        return directory / f"process_{jax.process_index()}-of-{jax.process_count()}.json"

    def save(self, directory: epath.Path, args: DataStateSave) -> None:
        self._file(directory).write_text(json.dumps(args.state))

    def restore(self, directory: epath.Path, args: DataStateRestore | None = None) -> Any:
        """This process's saved position, or None if the checkpoint was written
        by a different number of processes (positions are per process share)."""
        path = self._file(directory)
        if not path.exists():
            if not list(directory.glob("process_*-of-*.json")):
                raise CheckpointError(f"{directory} holds no input positions")
            return None
        return json.loads(path.read_text())

    def metadata(self, directory: epath.Path) -> None:
        return None


@ocp.args.register_with_handler(DataStateHandler, for_save=True)
@dataclasses.dataclass
class DataStateSave(ocp.args.CheckpointArgs):
    state: Any


@ocp.args.register_with_handler(DataStateHandler, for_restore=True)
@dataclasses.dataclass
class DataStateRestore(ocp.args.CheckpointArgs):
    pass


def _key(path) -> str:
    # Metadata comes back as nested dicts where the state had NamedTuples, so
    # compare paths by their names only.
    return "/".join(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _first_mismatch(abstract, metadata) -> str | None:
    """Names the first leaf whose checkpointed shape differs from the target's."""
    saved = {_key(p): m for p, m in jax.tree_util.tree_leaves_with_path(metadata)}
    for path, leaf in jax.tree_util.tree_leaves_with_path(abstract):
        key = _key(path)
        if key not in saved:
            return f"{key} is not in the checkpoint"
        shape = tuple(getattr(saved[key], "shape", ()) or ())
        if shape != tuple(leaf.shape):
            return f"{key} has shape {shape} in the checkpoint but {tuple(leaf.shape)} here"
    return None


class Checkpointer:
    """Saves and restores train states under ``workdir/checkpoints``.

    Args:
      workdir: the run directory.
      keep: how many of the latest checkpoints to keep.
      async_save: write in the background while training continues.
    """

    def __init__(self, workdir: str, *, keep: int, async_save: bool = True):
        self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, enable_async_checkpointing=async_save, create=True
            ),
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "data": DataStateHandler(),
                "config": ocp.JsonCheckpointHandler(),
            },
        )

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints, oldest first."""
        self._manager.reload()  # another process may have written since
        return sorted(self._manager.all_steps())

    def save(self, step: int, logical_state, data_state, config: ml_collections.ConfigDict):
        """Starts saving (returns before the write finishes if async)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(logical_state._asdict()),
                data=DataStateSave(data_state),
                config=ocp.args.JsonSave(json.loads(config.to_json_best_effort())),
            ),
            force=True,
        )

    def restore(self, abstract_logical_state) -> tuple[int, Any, Any] | None:
        """Restores the newest readable checkpoint into the given abstract state.

        Returns:
          ``(step, logical_state_dict, data_state)``, or None if there are no
          checkpoints.

        Raises:
          CheckpointMismatchError: naming the first parameter whose shape differs.
          CheckpointError: when checkpoints exist but none can be read.
        """
        steps = self.steps()
        target = abstract_logical_state._asdict()
        problems = []
        for step in reversed(steps):
            try:
                metadata = self._manager.item_metadata(step)["state"]
                mismatch = _first_mismatch(target, metadata)
            except Exception as e:  # noqa: BLE001  (any unreadable file: try older ones)
                mismatch, problems = None, [*problems, f"step {step}: {type(e).__name__}: {e}"]
                print(f"warning: checkpoint {step} is unreadable ({e}); trying an older one",
                      file=sys.stderr, flush=True)  # fmt: skip
                continue
            if mismatch:
                raise CheckpointMismatchError(
                    f"checkpoint {step} in {self.directory} does not fit this config: {mismatch}"
                )
            try:
                restored = self._manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(target), data=DataStateRestore()
                    ),
                )
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001
                problems.append(f"step {step}: {type(e).__name__}: {e}")
                print(f"warning: checkpoint {step} is unreadable ({e}); trying an older one",
                      file=sys.stderr, flush=True)  # fmt: skip
                continue
            return step, restored["state"], restored["data"]
        if steps:
            raise CheckpointError(
                f"none of the checkpoints {steps} in {self.directory} can be read "
                f"({'; '.join(problems)[:500]}); move the directory away to start over"
            )
        return None

    def reached_preemption(self, step: int) -> bool:
        """Whether JAX's preemption service asks all hosts to stop at ``step``."""
        return self._manager.reached_preemption(step)

    def wait(self) -> None:
        """Blocks until the last save is on disk."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Waits for pending saves and releases the manager."""
        self._manager.close()
