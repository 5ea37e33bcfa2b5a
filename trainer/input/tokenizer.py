"""Tokenizers: SentencePiece models trained on a run's data, and existing ones used as
they are.

Translation (:class:`Vocab`: :class:`SentencePieceVocab`, and a trivial one for
benchmarks) uses the same special ids, which the model and the loss rely on:
PAD = 0 (also the value of padding rows and positions), EOS = 1 (appended by
`encode`, ends `decode`), UNK = 2. There is no BOS: the decoder's start token
comes from shifting targets right, which inserts PAD.

Language models (:class:`TextTokenizer`) take a tokenizer as it comes: a SentencePiece
``.model`` (trained on the corpus with PAD 0, EOS 1, UNK 2, BOS 3 and, for masked
language models, ``<mask>`` 4; or any other), or a Hugging Face ``tokenizer.json``
through the ``tokenizers`` library, read as ``transformers`` reads it: BOS is what its
post-processor puts before a text (whatever ``tokenizer_config.json`` names), EOS the
``eos_token`` of ``tokenizer_config.json`` (else what the post-processor puts after a
text), and generation stops at the ``eos_token_id`` of ``generation_config.json``
beside it (one id or a list: Llama 3 Instruct's three). ``encode`` adds no special
token: documents are joined as BOS, tokens, EOS by the pipeline
(:mod:`trainer.input.language`).
"""

import contextlib
import io
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from typing import Protocol

import numpy as np
import sentencepiece as spm

from trainer import console
from trainer.errors import ConfigError
from trainer.workdir import storage

PAD_ID = 0
EOS_ID = 1
UNK_ID = 2
FIRST_REGULAR_ID = 3
BOS_ID = 3  # language models' SentencePiece only (translation's has none)
MASK_PIECE = "<mask>"  # masked language models' SentencePiece only
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


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    *,
    description: str,
    bos: bool = False,
    symbols: tuple[str, ...] = (),
) -> bytes:
    """Trains a unigram SentencePiece model with the pipeline's special ids.

    Args:
      texts: Training sentences; all of them are used (sample them beforehand).
      vocab_size: Exact size of the vocabulary, special ids included.
      description: Names the training data in error messages.
      bos: also a BOS piece, id 3 (language models).
      symbols: pieces of their own after those (``<mask>``), ids 4, 5, ...

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
            bos_id=BOS_ID if bos else -1,
            user_defined_symbols=list(symbols),
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


def _trained(
    vocab_path: str,
    vocab_size: int,
    training_texts: Callable[[], Iterable[str]],
    description: str,
    **options,
) -> bytes:
    """The SentencePiece model at ``vocab_path``, trained there first if it is missing
    (``options`` of :func:`train_sentencepiece`)."""
    path = storage.path(vocab_path)
    if not path.exists():
        # Minutes for WMT (seconds for the embedded data); once per vocabulary file.
        with console.phase(f"training a {vocab_size}-piece vocabulary on {description}"):
            model_proto = train_sentencepiece(
                training_texts(), vocab_size, description=description, **options
            )
        if storage.is_remote(path):
            # An object appears whole or not at all, and every process trains
            # the same model from the same text: a plain write is enough.
            path.write_bytes(model_proto)
        else:
            _publish_locally(str(path), model_proto)
    return path.read_bytes()


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
    vocab = SentencePieceVocab(
        _trained(vocab_path, vocab_size, training_texts, description), source=vocab_path
    )
    if vocab.vocab_size > vocab_size:
        raise ConfigError(
            f"SentencePiece model {vocab_path} has {vocab.vocab_size} pieces but the config "
            f"says vocab_size={vocab_size}; ids would overflow the embedding. Fix vocab_size "
            "or vocab_path."
        )
    return vocab


# ------------------------------------------------------------ language models


class TextTokenizer(Protocol):
    """What a language model's pipeline and its generator need from a tokenizer.

    Attributes:
      vocab_size: ids the tokenizer may give (the model's table must hold them).
      bos_id: begins every document and prompt (None: the tokenizer adds none).
      eos_id: ends every document, and generation.
      stop_ids: the ids that end generation (``eos_id``, or a model's list of them).
      pad_id: the padding token it names (None: none).
      mask_id: the masked language model's mask (None: none).
      files: what a run keeps to load it again without its source (name -> bytes).
      kind: ``"sentencepiece"`` or ``"huggingface"``.
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    stop_ids: tuple[int, ...]
    pad_id: int | None
    mask_id: int | None
    files: dict[str, bytes]
    kind: str
    source: str  # where it was read from, for messages

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special token added."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """:meth:`encode` of each text (in parallel where the library can)."""

    def decode(self, ids: Iterable[int]) -> str:
        """The text of ``ids`` (special tokens left out)."""

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` with no special token added, the text of a special token
        becoming its id (as ``transformers`` tokenizes a rendered chat template), and
        each token's ``[start, end)`` character offsets in ``text``."""

    def token_id(self, token: str) -> int | None:
        """The id of a token's text (``<|eot_id|>``), or None if it has none."""

    def piece(self, token_id: int) -> str:
        """The text of one token (a special one's too: ``<s>``)."""


SPM_FILE = "tokenizer.model"
# A Hugging Face tokenizer's files, and the ids a model's generation stops at (kept
# with it: a run started from a model directory stops where the model does).
GENERATION_FILE = "generation_config.json"
HF_FILES = ("tokenizer.json", "tokenizer_config.json", GENERATION_FILE)


class SentencePieceTokenizer:
    """A SentencePiece ``.model`` as a :class:`TextTokenizer`: its own special ids."""

    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, *, source: str = "<in memory>"):
        try:
            self._processor = spm.SentencePieceProcessor(model_proto=model_proto)
        except RuntimeError as e:
            raise ConfigError(f"{source} is not a SentencePiece model ({e})") from None
        if not model_proto or self._processor.vocab_size() <= 0:  # loads empty, then fails
            raise ConfigError(f"{source} is not a SentencePiece model (it is empty)")
        self.files = {SPM_FILE: model_proto}
        self.source = source
        self.vocab_size = self._processor.vocab_size()
        self.bos_id = _id_or_none(self._processor.bos_id())
        self.eos_id = _id_or_none(self._processor.eos_id())
        self.stop_ids = () if self.eos_id is None else (self.eos_id,)
        self.pad_id = _id_or_none(self._processor.pad_id())
        mask = self._processor.piece_to_id(MASK_PIECE)
        self.mask_id = None if mask == self._processor.unk_id() else mask

    def encode(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._processor.encode(texts, num_threads=_TRAINER_THREADS)

    def decode(self, ids: Iterable[int]) -> str:
        specials = {self.bos_id, self.eos_id, self._processor.pad_id()}
        return self._processor.decode([int(i) for i in ids if int(i) not in specials])

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        # SentencePiece reads "<s>" in a text as characters: the text is cut at the BOS
        # and EOS pieces' strings, which become their ids, and the rest encoded between.
        specials = {
            self._processor.id_to_piece(i): i for i in (self.bos_id, self.eos_id) if i is not None
        }
        ids: list[int] = []
        offsets: list[tuple[int, int]] = []
        at = 0
        while at <= len(text):
            found = [(text.find(p, at), p) for p in specials if text.find(p, at) >= 0]
            end, piece = min(found) if found else (len(text), None)
            if end > at:
                self._encode_span(text[at:end], at, ids, offsets)
            if piece is None:
                break
            ids.append(specials[piece])
            offsets.append((end, end + len(piece)))
            at = end + len(piece)
        return ids, offsets

    def _encode_span(self, span: str, start: int, ids: list, offsets: list) -> None:
        """Appends the ids of ``span`` (at ``start`` in its text) and their character
        offsets, SentencePiece giving byte offsets into the UTF-8 of ``span``."""
        encoded = span.encode("utf-8")
        to_char = np.zeros(len(encoded) + 1, np.int64)
        position = 0
        for i, character in enumerate(span):
            width = len(character.encode("utf-8"))
            to_char[position : position + width] = i
            position += width
        to_char[len(encoded)] = len(span)
        for piece in self._processor.encode(span, return_type="proto").pieces:
            ids.append(piece.id)
            offsets.append((start + int(to_char[piece.begin]), start + int(to_char[piece.end])))

    def token_id(self, token: str) -> int | None:
        found = self._processor.piece_to_id(token)
        return None if found == self._processor.unk_id() else found

    def piece(self, token_id: int) -> str:
        return self._processor.id_to_piece(int(token_id))


class HfTokenizer:
    """A Hugging Face ``tokenizer.json`` (``tokenizers`` library) as a :class:`TextTokenizer`,
    its special ids as ``transformers`` takes them (the module docstring)."""

    kind = "huggingface"

    def __init__(self, files: dict[str, bytes], *, source: str):
        import tokenizers  # noqa: PLC0415  (only for Hugging Face tokenizers)

        try:
            self._tokenizer = tokenizers.Tokenizer.from_str(files["tokenizer.json"].decode())
        except Exception as e:  # noqa: BLE001  (the library's errors: not a tokenizer.json)
            raise ConfigError(f"{source} is not a Hugging Face tokenizer.json ({e})") from None
        self.files = dict(files)
        self.source = source
        settings = json_object(files, "tokenizer_config.json", source)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        before, after = self._added_around_a_text()
        # transformers adds what the post-processor adds, whatever bos_token says.
        self.bos_id = before[0] if before else None
        self.eos_id = self._special(settings.get("eos_token"), "eos_token", source)
        if self.eos_id is None and after:
            self.eos_id = after[-1]
        self.pad_id = self._special(settings.get("pad_token"), "pad_token", source)
        self.mask_id = self._special(settings.get("mask_token"), "mask_token", source)
        self.stop_ids = _stop_ids(files, source, self.eos_id, self.vocab_size)

    def _added_around_a_text(self) -> tuple[list[int], list[int]]:
        """The special ids the post-processor puts before and after a text."""
        encoding = self._tokenizer.encode("a", add_special_tokens=True)
        ids, special = encoding.ids, encoding.special_tokens_mask
        first = next((i for i, s in enumerate(special) if not s), len(ids))
        last = next((i for i in range(len(ids) - 1, -1, -1) if not special[i]), first - 1)
        return ids[:first], ids[last + 1 :]

    def _special(self, token, field: str, source: str) -> int | None:
        if isinstance(token, dict):  # {"content": "<s>", ...}, as older configs write it
            token = token.get("content")
        if not token:
            return None
        if not isinstance(token, str):
            raise ConfigError(
                f"{source}: tokenizer_config.json's {field}={token!r} is not a token (a string)"
            )
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        return encoding.ids, [tuple(o) for o in encoding.offsets]

    def token_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def piece(self, token_id: int) -> str:
        return self._tokenizer.id_to_token(int(token_id))


def json_object(files: dict[str, bytes], name: str, source: str) -> dict:
    """The JSON object of ``files[name]`` ({} where there is none).

    Raises:
      ConfigError: it is not a JSON object, naming the file.
    """
    try:
        value = json.loads(files.get(name) or b"{}")
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{source}: {name} is not JSON ({' '.join(str(e).split())})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{source}: {name} holds a JSON {type(value).__name__}, not an object")
    return value


def _stop_ids(
    files: dict[str, bytes], source: str, eos_id: int | None, vocab_size: int
) -> tuple[int, ...]:
    """The ids generation stops at: ``generation_config.json``'s ``eos_token_id`` (an
    id or a list), else ``eos_id``.

    Raises:
      ConfigError: an ``eos_token_id`` that is not an id of the vocabulary, or a list of them.
    """
    stops = json_object(files, GENERATION_FILE, source).get("eos_token_id")
    if stops is None:
        return () if eos_id is None else (eos_id,)
    listed = stops if isinstance(stops, list) else [stops]
    if not listed or not all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in listed
    ):
        raise ConfigError(
            f"{source}: {GENERATION_FILE}'s eos_token_id={json.dumps(stops)} is not an id "
            f"below the vocabulary's {vocab_size} (or a list of them)"
        )
    return tuple(dict.fromkeys(listed))


def _id_or_none(i: int) -> int | None:
    return None if i < 0 else i


def load_text_tokenizer(location: str | os.PathLike) -> TextTokenizer:
    """The tokenizer at ``location``: a SentencePiece ``.model``, a Hugging Face
    ``tokenizer.json``, or a directory holding either (a Hugging Face model's, a run's,
    an export's).

    Raises:
      ConfigError: nothing there is a tokenizer.
    """
    path = storage.path(location)
    if path.is_dir():
        for name in (HF_FILES[0], SPM_FILE):
            if (path / name).exists():
                return load_text_tokenizer(path / name)
        raise ConfigError(f"{path} holds no tokenizer: expected {HF_FILES[0]} or {SPM_FILE} in it")
    if not path.exists():
        raise ConfigError(f"no tokenizer at {path}")
    if path.name.endswith(".json"):
        files = {"tokenizer.json": path.read_bytes()}
        for name in HF_FILES[1:]:  # beside it: its special tokens, where generation stops
            if (beside := path.parent / name).exists():
                files[name] = beside.read_bytes()
        return HfTokenizer(files, source=str(path))
    return SentencePieceTokenizer(path.read_bytes(), source=str(path))


def tokenizer_from_files(files: dict[str, bytes], source: str) -> TextTokenizer:
    """A tokenizer from the files a run kept (:attr:`TextTokenizer.files`)."""
    if "tokenizer.json" in files:
        return HfTokenizer(files, source=source)
    if SPM_FILE in files:
        return SentencePieceTokenizer(files[SPM_FILE], source=source)
    raise ConfigError(f"{source} keeps no tokenizer ({', '.join(HF_FILES)} or {SPM_FILE})")


def train_text_tokenizer(
    path: str,
    vocab_size: int,
    texts: Callable[[], Iterable[str]],
    *,
    description: str,
    mask: bool = False,
) -> SentencePieceTokenizer:
    """The SentencePiece model at ``path``, trained on ``texts()`` first if missing
    (PAD 0, EOS 1, UNK 2, BOS 3, and ``<mask>`` 4 with ``mask``)."""
    model = _trained(
        path, vocab_size, texts, description, bos=True, symbols=(MASK_PIECE,) if mask else ()
    )
    return SentencePieceTokenizer(model, source=path)
