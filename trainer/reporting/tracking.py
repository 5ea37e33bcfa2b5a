"""Optional Weights & Biases logging: ``wandb.project`` in the config.

Everything :class:`trainer.reporting.metrics.MetricWriter` writes to ``metrics.jsonl`` is
also logged to W&B at the same step, with the resolved config. The W&B run id is
kept in ``<workdir>/wandb_run_id``, so a restarted (resumed) run continues the
same W&B run rather than starting a new one. ``WANDB_MODE=offline`` (W&B's own
variable) logs to local files that ``wandb sync`` uploads later. W&B's local files
go to ``<workdir>/wandb`` for a local workdir, else to W&B's default directory.
Install with ``pip install -e '.[wandb]'``.
"""

from __future__ import annotations

import os
import secrets
import string

import ml_collections
from etils import epath

from trainer import console
from trainer.errors import ConfigError
from trainer.workdir import storage

RUN_ID_FILE = "wandb_run_id"


class WandbRun:
    """A W&B run that the metric writer logs scalars to."""

    def __init__(self, run):
        self._run = run

    @property
    def id(self) -> str:
        return self._run.id

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Logs ``scalars`` at ``step``."""
        self._run.log(scalars, step=step)

    def close(self) -> None:
        """Finishes the run (uploads, or closes the offline files)."""
        self._run.finish()


def start(config: ml_collections.ConfigDict, workdir: epath.Path) -> WandbRun | None:
    """Starts (or resumes) the W&B run of ``workdir``; None without ``wandb.project``.

    Call on the process that writes metrics only.

    Raises:
      ConfigError: ``wandb.project`` is set but wandb is not installed.
    """
    if not config.wandb.project:
        return None
    try:
        import wandb  # noqa: PLC0415
    except ImportError:
        raise ConfigError(
            f"wandb.project={config.wandb.project} needs wandb: pip install -e '.[wandb]'"
        ) from None
    id_file = workdir / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
    else:
        # W&B's id format: a few lowercase letters and digits.
        run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
        id_file.write_text(run_id + "\n")
    run = wandb.init(
        project=config.wandb.project,
        entity=config.wandb.entity,
        id=run_id,
        resume="allow",
        name=workdir.name,
        dir=None if storage.is_remote(workdir) else str(workdir),
        config=config.to_dict(),
        settings=wandb.Settings(silent=True),
    )
    # W&B itself is silenced (its banner would drown the progress lines): say where it went.
    if run.settings.mode in ("offline", "dryrun"):
        local = os.path.dirname(run.dir)  # .../wandb/offline-run-<time>-<id>
        console.say(
            f"W&B run {run.id} is offline, written to {local}; upload it: wandb sync {local}"
        )
    else:
        console.say(f"W&B run: {run.url}")
    return WandbRun(run)
