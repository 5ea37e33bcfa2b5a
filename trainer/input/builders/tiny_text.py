"""`tiny_text`: a local, synthetic corpus of documents for the `:tiny` language models.

Each document is one line: a sentence of the toy English of
:mod:`trainer.input.builders.tiny_translation`, then ``=>``, then its toy-German
translation, e.g. ``the big dog sees a cat => DET Dog big DET Cat sees``. A language
model learns the grammar of the first half and, to predict the second, to translate
it: prompted with a sentence and ``=>`` it continues with the translation, a
continuation anyone can check. Generated from code (no download), the same on every
machine, and written on first use as ``train.txt`` and ``eval.txt`` under
``<data_dir>/tiny_text/`` (a document a line, as ``data.document="line"`` reads).
"""

from __future__ import annotations

import os

from trainer.input.builders import tiny_translation
from trainer.workdir import storage

DATASET_NAME = "tiny_text"
NUM_TRAIN = 20_000
NUM_EVAL = 500
SEPARATOR = "=>"


def documents(count: int) -> list[str]:
    """The first ``count`` documents (the train split's, then the eval split's)."""
    return [f"{en} {SEPARATOR} {de}" for en, de in tiny_translation.generate_pairs(count)]


def prepare(data_dir: str) -> tuple[str, str]:
    """Writes the corpus under ``data_dir`` if it is missing; returns the paths of its
    train and eval files."""
    directory = storage.path(data_dir) / DATASET_NAME
    train, evals = directory / "train.txt", directory / "eval.txt"
    if not (train.exists() and evals.exists()):
        corpus = documents(NUM_TRAIN + NUM_EVAL)
        directory.mkdir(parents=True, exist_ok=True)
        # Written whole: another process reading at the same time sees the old file or this.
        storage.write_atomically(evals, "".join(d + "\n" for d in corpus[NUM_TRAIN:]))
        storage.write_atomically(train, "".join(d + "\n" for d in corpus[:NUM_TRAIN]))
    return os.fspath(train), os.fspath(evals)
