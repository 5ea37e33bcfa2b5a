"""Tokenizers of the translation pipeline: SentencePiece, and a trivial one for benchmarks.

Every tokenizer uses the same special ids, which the model and the loss rely on:
PAD = 0 (also the value of padding rows and positions), EOS = 1 (appended by
`encode`, ends `decode`), UNK = 2. There is no BOS: the decoder's start token
comes from shifting targets right, which inserts PAD.
"""

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Protocol

import sentencepiece as spm

from trainer import console
from trainer.errors import ConfigError
from trainer.workdir import storage

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
FIRST_REGULAR_ID = 3
# Fixed rather than os.cpu_count(): the trained model depends on the thread
# count, and every machine must train the same vocabulary from the same text.
_TRAINER_THREADS = 8


class Vocab(Protocol):
    """What the pipeline and the trainer need from a tokenizer."""

    pad_id: int
    eos_id: int

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _until_eos(ids: Iterable[int]) -> list[int]:
    """Ids before the first EOS, without PAD."""
    kept = []
    for token in ids:
        token = int(token)
        if token == EOS_ID:
            break
        if token != PAD_ID:
            kept.append(token)
    return kept


class SentencePieceVocab:
    """A SentencePiece model with PAD=0, EOS=1, UNK=2 and no BOS."""

    pad_id = PAD_ID
    eos_id = EOS_ID

    def __init__(self, model_proto: bytes, *, source: str = "<in memory>"):
        """Loads a serialized SentencePiece model.

        Args:
          model_proto: The bytes of a `.model` file.
          source: Where the model came from, for error messages.

        Raises:
          ValueError: If the model's special ids differ from PAD=0, EOS=1, UNK=2,
            BOS=-1 (such a model would silently corrupt padding and masking).
        """
        self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
        self.serialized = model_proto  # the .model file's bytes, to keep with a run
        ids = (
            self._processor.pad_id(),
            self._processor.eos_id(),
            self._processor.unk_id(),
            self._processor.bos_id(),
        )
        if ids != (PAD_ID, EOS_ID, UNK_ID, -1):
            raise ConfigError(
                f"SentencePiece model {source} has (pad, eos, unk, bos) ids {ids}; this "
                f"pipeline needs ({PAD_ID}, {EOS_ID}, {UNK_ID}, -1). Delete it to retrain."
            )

    @property
    def vocab_size(self) -> int:
        """Number of ids, including PAD, EOS and UNK."""
        return self._processor.vocab_size()

    def encode(self, text: str) -> list[int]:
        """Tokenizes `text` and appends EOS."""
        return self._processor.encode(text) + [EOS_ID]

    def decode(self, ids: Iterable[int]) -> str:
        """Detokenizes `ids` up to the first EOS, ignoring PAD."""
        return self._processor.decode(_until_eos(ids))


class SyntheticVocab:
    """Stand-in tokenizer for the synthetic benchmark data: ids are the text."""

    pad_id = PAD_ID
    eos_id = EOS_ID

    def __init__(self, vocab_size: int):
        """Creates a vocabulary of `vocab_size` ids."""
        self._vocab_size = vocab_size

    @property
    def vocab_size(self) -> int:
        """Number of ids, including PAD, EOS and UNK."""
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        """Parses space-separated ids (out-of-range ones become UNK) and appends EOS."""
        ids = [int(word) for word in text.split()]
        return [i if FIRST_REGULAR_ID <= i < self._vocab_size else UNK_ID for i in ids] + [EOS_ID]

    def decode(self, ids: Iterable[int]) -> str:
        """Joins the ids before the first EOS as decimal strings, ignoring PAD."""
        return " ".join(str(i) for i in _until_eos(ids))


def train_sentencepiece(texts: Iterable[str], vocab_size: int, *, description: str) -> bytes:
    """Trains a unigram SentencePiece model with the pipeline's special ids.

    Args:
      texts: Training sentences; all of them are used (sample them beforehand).
      vocab_size: Exact size of the vocabulary, special ids included.
      description: Names the training data in error messages.

    Returns:
      The serialized model.

    Raises:
      ValueError: If `vocab_size` is larger than the text supports.
    """
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="unigram",
            pad_id=PAD_ID,
            eos_id=EOS_ID,
            unk_id=UNK_ID,
            bos_id=-1,
            # Keep every character: translation must reproduce rare letters.
            character_coverage=1.0,
            # The caller already sampled; SentencePiece's own sampling is not
            # seeded by us and would make the model differ between runs.
            input_sentence_size=0,
            shuffle_input_sentence=False,
            num_threads=_TRAINER_THREADS,
            minloglevel=2,
        )
    except RuntimeError as e:
        raise ConfigError(
            f"Could not train a {vocab_size}-piece SentencePiece model on {description}: {e}"
        ) from e
    return model.getvalue()


def _publish_locally(vocab_path: str, model_proto: bytes) -> None:
    """Writes ``vocab_path`` atomically unless another process did first."""
    directory = os.path.dirname(vocab_path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=".spm-", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from other users.
        with os.fdopen(fd, "wb") as f:
            f.write(model_proto)
            f.flush()
            os.fsync(f.fileno())
        # If another process published its model first, use that one.
        with contextlib.suppress(FileExistsError):
            os.link(tmp_path, vocab_path)
    finally:
        os.unlink(tmp_path)


def load_or_train_sentencepiece(
    vocab_path: str,
    vocab_size: int,
    training_texts: Callable[[], Iterable[str]],
    *,
    description: str,
) -> SentencePieceVocab:
    """Loads the SentencePiece model at `vocab_path`, training and saving it first if absent.

    Saving is atomic (on local disks, first-writer-wins by a hard link of a
    complete temporary file; in object stores, by the store), so concurrent
    processes all end up loading the same file even if they all trained a model.

    Args:
      vocab_path: Path or URL (``gs://...``) of the `.model` file.
      vocab_size: Vocabulary size to train with; an existing model may be
        smaller (the model's embedding is then partly unused) but not larger.
      training_texts: Returns the training sentences; only called if the file
        is missing.
      description: Names the training data in messages and errors.

    Returns:
      The loaded vocabulary.

    Raises:
      ValueError: If an existing model is larger than `vocab_size` or has other
        special ids.
    """
    path = storage.path(vocab_path)
    if not path.exists():
        # Minutes for WMT (seconds for the embedded data); once per vocabulary file.
        with console.phase(f"training a {vocab_size}-piece vocabulary on {description}"):
            model_proto = train_sentencepiece(training_texts(), vocab_size, description=description)
        if storage.is_remote(path):
            # An object appears whole or not at all, and every process trains
            # the same model from the same text: a plain write is enough.
            path.write_bytes(model_proto)
        else:
            _publish_locally(str(path), model_proto)
    vocab = SentencePieceVocab(path.read_bytes(), source=vocab_path)
    if vocab.vocab_size > vocab_size:
        raise ConfigError(
            f"SentencePiece model {vocab_path} has {vocab.vocab_size} pieces but the config "
            f"says vocab_size={vocab_size}; ids would overflow the embedding. Fix vocab_size "
            "or vocab_path."
        )
    return vocab
