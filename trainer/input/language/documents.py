"""Documents as tokens: the tokenizer (configured, or trained on the corpus), each
document's ``BOS, tokens, EOS`` and their token counts (cached per corpus and
tokenizer)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from trainer.errors import ConfigError
from trainer.input import options, packing, text_files
from trainer.input import tokenizer as tokenizer_lib
from trainer.input.language.options import LanguageOptions
from trainer.workdir import storage

# Documents a trained SentencePiece model learns from: evenly spaced over the corpus.
VOCAB_TRAIN_DOCUMENTS = 200_000


class TextDocuments:
    """Documents held as text, tokenized when a row needs them (picklable)."""

    def __init__(self, documents: text_files.Documents, tokenizer, lengths: np.ndarray):
        self._texts, self._tokenizer, self.lengths = documents.texts, tokenizer, lengths

    def tokens(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Each document's tokens, BOS and EOS included."""
        encoded = self._tokenizer.encode_batch([self._texts[int(i)] for i in indices])
        return [with_specials(ids, self._tokenizer) for ids in encoded]


class DocumentSubset:
    """Some of a collection's documents (``lengths`` and ``tokens`` as it has them), in
    the order of ``indices`` (picklable where the collection is)."""

    def __init__(self, documents, indices: np.ndarray):
        self._documents, self._indices = documents, np.asarray(indices, np.int64)
        self.lengths = np.asarray(documents.lengths)[self._indices]

    def tokens(self, indices: Sequence[int]) -> list[np.ndarray]:
        return self._documents.tokens([int(self._indices[int(i)]) for i in indices])


# The key of the held-out draw in the seeded generator (the training order's is 0).
_HOLDOUT_STREAM = 2


def hold_out(count: int, share: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(training, held-out)`` indices of ``count`` documents: ``round(share * count)``
    of them (at least one, and at least one left to train on) drawn by a generator
    seeded with ``seed``, both in file order: the same on every process."""
    if count < 2:
        raise ConfigError(
            f"data.train_files hold {count} document: nothing to hold out for evaluation "
            "(give data.eval_files)"
        )
    held = min(max(1, round(share * count)), count - 1)
    drawn = np.random.default_rng((seed, _HOLDOUT_STREAM)).permutation(count)
    return np.sort(drawn[held:]), np.sort(drawn[:held])


# A continuation's prompt: a held-out document's first tokens, at most this many (and
# at most half of it), then the SAMPLE_TOKENS a sample's continuation is shown beside.
PROMPT_TOKENS = 12
SAMPLE_TOKENS = 16


def document_prompts(documents: Sequence[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(prompt, held-out continuation)`` of each document: its first tokens (at most
    :data:`PROMPT_TOKENS`, at most half of it) and the next :data:`SAMPLE_TOKENS`."""
    out = []
    for doc in documents:
        cut = max(1, min(PROMPT_TOKENS, len(doc) // 2))
        out.append((doc[:cut], doc[cut : cut + SAMPLE_TOKENS]))
    return out


def check_vocabulary(tokenizer, vocab_size: int) -> None:
    """Raises ConfigError if ``tokenizer``'s ids would fall outside an embedding table
    of ``vocab_size`` rows (a table larger than the tokenizer, as Qwen2's, is fine)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"the tokenizer {tokenizer.source} has {tokenizer.vocab_size:,} ids but "
            f"model.vocab_size={vocab_size:,}: its ids would fall outside the embedding"
        )


def with_specials(ids: Sequence[int], tokenizer) -> np.ndarray:
    """``BOS, ids, EOS`` (each where the tokenizer has one), int32."""
    bos = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    return np.asarray([*bos, *ids, *eos], np.int32)


def document_lengths(cache_dir: str, documents: text_files.Documents, tokenizer) -> np.ndarray:
    """int32 [documents]: each document's tokens with its BOS and EOS, cached in
    ``cache_dir`` under the corpus's and the tokenizer's digests."""
    tokenizer_digest = hashlib.sha256(
        b"".join(tokenizer.files[name] for name in sorted(tokenizer.files))
    ).hexdigest()[:12]
    name = f"{text_files.NAME}_{documents.digest}.{tokenizer_digest}.lengths.npy"
    path = storage.path(options.data_dir(cache_dir)) / name
    specials = (tokenizer.bos_id is not None) + (tokenizer.eos_id is not None)
    lengths = packing.token_lengths(
        path,
        len(documents),
        lambda indices: [documents[i] for i in indices],
        lambda texts: [[len(ids) + specials] for ids in tokenizer.encode_batch(list(texts))],
        width=1,
        what="documents",
    )
    return lengths[:, 0]


def sample(documents: Iterable[str], size: int = VOCAB_TRAIN_DOCUMENTS) -> list[str]:
    """Every k-th document, k the smallest power of two that keeps at most ``size``."""
    kept: list[str] = []
    every = 1
    for i, document in enumerate(documents):
        if i % every == 0:
            kept.append(document)
            if len(kept) > size:
                kept, every = kept[::2], every * 2
    return kept


def tokenizer_for(lm: LanguageOptions, documents: text_files.Documents, data_dir: str):
    """The configured tokenizer, or a SentencePiece model trained on ``documents``."""
    if lm.tokenizer:
        return tokenizer_lib.load_text_tokenizer(lm.tokenizer)
    name = f"{text_files.NAME}_{documents.digest}_spm_{lm.vocab_size}"
    path = str(
        storage.path(options.data_dir(data_dir)) / f"{name}{'_mask' if lm.masked else ''}.model"
    )

    def texts() -> Iterator[str]:
        count = min(len(documents), VOCAB_TRAIN_DOCUMENTS)
        for index in np.linspace(0, len(documents) - 1, count, dtype=np.int64):
            yield documents[int(index)]

    what = f"{min(len(documents), VOCAB_TRAIN_DOCUMENTS):,} documents of data.train_files"
    return tokenizer_lib.train_text_tokenizer(
        path, lm.vocab_size, texts, description=what, mask=lm.masked
    )


def check_tokenizer(tokenizer, lm: LanguageOptions) -> None:
    """Raises ConfigError where ``tokenizer`` cannot serve ``lm``'s rows."""
    if tokenizer.eos_id is None:
        raise ConfigError(
            "the tokenizer has no end-of-sequence token: documents could not be told apart "
            "and generation would never stop (name one in its tokenizer_config.json)"
        )
    if lm.masked and tokenizer.mask_id is None:
        raise ConfigError(
            "a masked language model needs a mask token, and this tokenizer has none "
            "(leave data.tokenizer empty to train one with <mask>)"
        )
