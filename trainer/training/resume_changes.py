"""What a resume changes: the run's recorded config and input against the new ones.

A resume continues a checkpoint with whatever config the command gives, and a config
changes the meaning of a checkpoint in ways nothing else would say: the learning
rate at the resume step moves when ``num_train_steps`` or the schedule does, a grown
corpus or another row length gives the remaining steps other batches, and another
tokenizer makes the checkpoint's embedding rows stand for other tokens. So before a
resumed run records itself, :func:`compare` reads the previous leg's config
(``DIR/config.json``), its input record (``DIR/input.json``: the tokenizer's digest
and the training files) and the files it kept (the tokenizer), and says one line per
change with what it does. Another tokenizer is refused unless the command accepts it
(``--accept_new_tokenizer``); the old tokenizer is then kept beside the new one, never
overwritten: the checkpoints before the resume were trained with it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from typing import Any

import ml_collections
from etils import epath

from trainer.errors import ConfigError
from trainer.input import tokenizer as tokenizer_lib
from trainer.training import optimizers
from trainer.workdir import run_config, storage

INPUT_RECORD = "input.json"
# Keys whose change moves the learning rate of the resume step.
_SCHEDULE_KEYS = (
    "num_train_steps",
    "optimizer.learning_rate",
    "optimizer.schedule",
    "optimizer.warmup_steps",
    "optimizer.warmup_ratio",
    "optimizer.end_learning_rate",
    "optimizer.power",
)
# Keys that change which rows the remaining steps read, and how.
_INPUT_KEYS = {
    "data.max_length": "rows of another length: the steps from here on cut the documents "
    "at other places (the input position counts batches of the old rows)",
    "global_batch_size": "batches of another size: the input position counts batches of the "
    "old size, so the rows from here on are not those an unchanged run would read",
    "seed": "another seed: another order of the documents (and another held-out share) "
    "from here on",
    "data.eval_holdout": "another held-out share: some evaluation documents were trained on, "
    "or some training documents are now held out",
}
# Keys that say nothing about the run's numbers: not reported.
_QUIET = ("compilation_cache_dir", "workdir_lock_timeout_s", "profile_steps", "wandb.")


@dataclasses.dataclass(frozen=True)
class Change:
    """One difference between the resumed run and this one.

    Attributes:
      what: the config key or input it concerns (``num_train_steps``, ``tokenizer``).
      before: its value in the resumed run; after: in this one (as text).
      effect: what the change does to the run ("" where the value says it all).
    """

    what: str
    before: str
    after: str
    effect: str = ""

    def line(self) -> str:
        return f"{self.what}: {self.before} -> {self.after}" + (
            f": {self.effect}" if self.effect else ""
        )


def digest(files: Mapping[str, bytes]) -> str:
    """A short digest of named files' contents (a tokenizer's)."""
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + files[name] + b"\0")
    return h.hexdigest()[:16]


def compare(
    directory: epath.Path,
    config: ml_collections.ConfigDict,
    run_files: Mapping[str, bytes],
    input_record: Mapping[str, Any],
    step: int,
    *,
    accept_new_tokenizer: bool = False,
) -> list[Change]:
    """The changes of resuming the run in ``directory`` at ``step`` with ``config``.

    Args:
      directory: the work directory (its config.json, input.json and kept files).
      config: this leg's config.
      run_files: the files this leg's task keeps (its tokenizer).
      input_record: this leg's input record (:func:`write_input_record`).
      step: the step resumed from.
      accept_new_tokenizer: another tokenizer than the run's is accepted.

    Raises:
      ConfigError: another tokenizer, not accepted.
    """
    try:
        before = run_config.load(str(directory), warn=False)
    except (FileNotFoundError, ValueError, OSError):
        return []  # nothing recorded to compare with (a run older than the records)
    changes = _config_changes(before, config, step)
    # The vocabulary's files: generation_config.json (stop ids) may change freely.
    run_files = {n: c for n, c in run_files.items() if n != tokenizer_lib.GENERATION_FILE}
    old_files = {
        name: (directory / name).read_bytes() for name in run_files if (directory / name).exists()
    }
    if old_files and digest(old_files) != digest(run_files):
        names = ", ".join(sorted(old_files))
        if not accept_new_tokenizer:
            raise ConfigError(
                f"this run was trained with another tokenizer ({names} in {directory}, "
                f"digest {digest(old_files)}; this one's is {digest(run_files)}): its "
                "checkpoints' embedding rows stand for that tokenizer's ids. Resume with the "
                "run's own tokenizer (leave data.tokenizer as the run had it), start a new "
                "--workdir, or pass --accept_new_tokenizer to go on with this one"
            )
        changes.append(
            Change(
                "tokenizer",
                digest(old_files),
                digest(run_files),
                f"accepted: the embedding rows now stand for other tokens; the run's tokenizer "
                f"is kept as {', '.join(_set_aside_name(n, step) for n in sorted(old_files))}",
            )
        )
    changes += _input_changes(_read_input_record(directory), input_record)
    return changes


def set_aside_old_files(directory: epath.Path, run_files: Mapping[str, bytes], step: int) -> None:
    """Keeps the run's files that ``run_files`` would replace under names of their own
    (``tokenizer.model.before-step-400``): the earlier checkpoints' tokenizer."""
    for name, content in run_files.items():
        kept = directory / name
        if kept.exists() and kept.read_bytes() != content:
            storage.write_atomically(directory / _set_aside_name(name, step), kept.read_bytes())


def write_input_record(directory: epath.Path, input_record: Mapping[str, Any]) -> None:
    """Records this leg's input (read by the next resume's :func:`compare`)."""
    storage.write_atomically(directory / INPUT_RECORD, json.dumps(input_record, indent=1))


def _set_aside_name(name: str, step: int) -> str:
    return f"{name}.before-step-{step}"


def _read_input_record(directory: epath.Path) -> dict:
    try:
        return json.loads((directory / INPUT_RECORD).read_text())
    except (OSError, ValueError):
        return {}


def _config_changes(
    before: ml_collections.ConfigDict, after: ml_collections.ConfigDict, step: int
) -> list[Change]:
    old, new = run_config.flat_config(before), run_config.flat_config(after)
    changes = []
    schedule_moved = False
    for key in sorted(set(old) | set(new)):
        if key.startswith(_QUIET) or old.get(key) == new.get(key):
            continue
        if key not in old:  # a key the resumed run's version of the trainer did not have
            continue
        effect = _INPUT_KEYS.get(key, "")
        if key in _SCHEDULE_KEYS:
            schedule_moved = True
        changes.append(Change(key, _text(old.get(key)), _text(new.get(key)), effect))
    if schedule_moved:
        rate = [_rate_at(c, step) for c in (before, after)]
        if rate[0] != rate[1]:
            changes.append(
                Change(
                    f"learning rate at step {step}",
                    f"{rate[0]:.3g}",
                    f"{rate[1]:.3g}",
                    "the schedule's rate where the run goes on",
                )
            )
    return changes


def _rate_at(config: ml_collections.ConfigDict, step: int) -> float:
    try:
        return float(optimizers.make_schedule(config.optimizer, config.num_train_steps)(step))
    except (ConfigError, KeyError, AttributeError):
        return float("nan")


def _input_changes(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[Change]:
    """Changes of the training files (names, bytes, documents) between two records."""
    if not before or not after or before.get("corpus") == after.get("corpus"):
        return []
    return [
        Change(
            "data.train_files",
            _describe_corpus(before),
            _describe_corpus(after),
            "another corpus: the steps from here on read another order of documents "
            "(the input position indexes the new corpus's shuffle)",
        )
    ]


def _describe_corpus(record: Mapping[str, Any]) -> str:
    files = record.get("files", [])
    size = sum(s for _, s in files)
    return f"{len(files)} file(s), {size / 1e6:.2f} MB, {record.get('documents', 0):,} documents"


def _text(value) -> str:
    return "(unset)" if value is None else repr(value) if isinstance(value, str) else str(value)
