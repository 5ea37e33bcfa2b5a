"""The ``data`` item of a checkpoint: the input position, as an Orbax handler.

Orbax records the handler's import path (``trainer.checkpoint.position.DataStateHandler``)
in each step's ``_CHECKPOINT_METADATA``; only as information, since
:class:`trainer.checkpoint.checkpointer.Checkpointer` names its handlers itself, so a checkpoint
that recorded another path restores all the same.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import jax
import orbax.checkpoint as ocp
from etils import epath

from trainer import faults


class DataStateHandler(ocp.AsyncCheckpointHandler):
    """Saves the input position, one JSON for the whole job.

    The position is global (the index of the next global batch, the same on every
    process; see trainer.input.feed), so process 0 writes it and any number of
    processes can resume from it. Written by the save's background commit, like
    the arrays (and where :mod:`trainer.faults`' ``save`` point is).
    """

    _FILE = "position.json"

    async def _write(self, directory: epath.Path, state: Any) -> None:
        faults.point("save")
        if jax.process_index() == 0:
            (directory / self._FILE).write_text(json.dumps(state))

    async def async_save(self, directory: epath.Path, args: DataStateSave) -> list:
        return [
            ocp.future.CommitFutureAwaitingContractedSignals(
                self._write(directory, args.state), name="position_save"
            )
        ]

    def save(self, directory: epath.Path, args: DataStateSave) -> None:
        asyncio.run(self._write(directory, args.state))

    def restore(self, directory: epath.Path, args: DataStateRestore | None = None) -> Any:
        state = json.loads((directory / self._FILE).read_text())
        if not isinstance(state, dict):
            raise ValueError(f"{directory / self._FILE} holds no input position: {state!r}")
        return state

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
