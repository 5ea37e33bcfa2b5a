"""What a run writes into its work directory once its state is known, before its
first step: the config it runs with, the files its task keeps for later use (the
tokenizer), and ``metrics.jsonl`` brought in line with the step it starts from."""

from __future__ import annotations

from collections.abc import Mapping

import ml_collections
from etils import epath

from trainer import console
from trainer.workdir import rows, run_config, storage


def begin(
    directory: epath.Path,
    config: ml_collections.ConfigDict,
    run_files: Mapping[str, bytes],
    step: int,
    *,
    started_over_from: epath.Path | None = None,
) -> None:
    """Records the run that starts at ``step`` (process 0 only).

    Args:
      directory: the work directory.
      config: the run's config, accepted (every check passed).
      run_files: the task's files to keep (name -> bytes); rewritten only if changed.
      step: the step the run starts from (a resumed checkpoint's, or 0).
      started_over_from: where the unusable checkpoints went, when none was left and
        the run starts from step 0 again: the old ``metrics.jsonl`` is set aside there
        (its rows describe steps that are lost), never deleted.
    """
    storage.write_atomically(directory / run_config.FILE, config.to_json_best_effort(indent=2))
    for name, content in run_files.items():
        if not (kept := directory / name).exists() or kept.read_bytes() != content:
            storage.write_atomically(kept, content)
    if started_over_from is not None:
        kept = rows.set_aside(directory, started_over_from)
        console.warn(
            f"no usable checkpoint is left in {started_over_from.parent}: this run starts from "
            "step 0" + (f"; the earlier {rows.METRICS} is kept as {kept}" if kept else "")
        )
    # Rows a run that died wrote after its checkpoint are logged again by this one.
    skipped, kept = rows.drop_rows_after(directory, step)
    if skipped:
        console.warn(rows.skipped_warning(directory / rows.METRICS, skipped, kept))
