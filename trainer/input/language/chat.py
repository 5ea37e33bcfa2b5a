"""Chat data for instruction fine-tuning: conversations from your files, rendered with
the model's own template (:mod:`trainer.input.chat_template`), as tokens and the mask
of those the loss counts.

Files: globs (local or ``gs://``, comma-separated) of ``.jsonl`` (optionally ``.gz``)
and ``.parquet``, a conversation a row, in the forms Hugging Face datasets and TRL use:
``{"messages": [{"role": ..., "content": ...}, ...]}``, or ``{"prompt": ...,
"completion": ...}``: two strings (a user message, its answer) or two lists of
messages (only the completion's answers are learnt). Roles: system, user, assistant,
tool; contents are strings; other keys (``tool_calls``...) reach the template as they
are. A damaged row (:data:`REASONS`) is skipped and counted by reason with the first
file and line of each, in one warning; a file with no conversation is an error.

Tokens: exactly ``apply_chat_template(messages)``'s ids, the rendered text tokenized
with no special token added: the template writes BOS and the ends of turns itself, so
nothing is put around a conversation (as BOS and EOS are around a document).

The loss counts the answers' tokens (``data.train_on_prompts``: every token). Answer
``i``'s span is what a generator writes from ``render(messages[:i],
add_generation_prompt=True)`` to ``render(messages[:i + 1])``: the content and the
end-of-turn token (``<|eot_id|>``, ``<|im_end|>``, ``</s>``), the span TRL's
``assistant_only_loss`` marks with ``{% generation %}``, here found for any template.
The assistant header is prompt (the generation prompt writes it); the end of turn is
learnt (a model that never writes it never stops); whitespace after it is the next
turn's (the generator stops before it). A token counts if it overlaps a span, as in
transformers' ``return_assistant_tokens_mask``. Where the prompt is written otherwise
once an answer follows (Mistral v0.3 moves the system message into the last user turn),
the span begins at the content (found with a stand-in) less the text the template
writes before any answer (Mistral's space); where a turn is written otherwise once more
follow, the span is found by its text in the whole rendering, after the previous one.

Packing (the pipeline's): whole conversations in rows, never cut, told apart by
segments. One longer than ``data.max_length`` tokens is skipped and counted in one
warning: cut, it would lose its end of turn (teaching the model not to stop) or its
second part would be learnt without its prompt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from etils import epath

from trainer.errors import ConfigError
from trainer.input import chat_template, corpus, options, packing
from trainer.workdir import storage

NAME = "chat"
ROLES = ("system", "user", "assistant", "tool")
_FORMATS = {".jsonl": "jsonl", ".parquet": "parquet"}
# Reasons a row is skipped, in the order a warning lists them.
REASONS = (
    "not UTF-8",
    "not a JSON object",
    "neither messages nor prompt and completion",
    "empty conversation",
    "message without a role",
    "unknown role",
    "content not a string",
    "no assistant message",
    "assistant message first",
)


@dataclasses.dataclass(frozen=True)
class Conversation:
    """One conversation.

    Attributes:
      messages: ``{"role", "content", ...}`` dicts, in order.
      train_from: the first message whose answers are learnt (a TRL prompt's length).
      where: its file and line (or Parquet row), for messages.
    """

    messages: tuple[dict[str, Any], ...]
    train_from: int = 0
    where: str = ""


@dataclasses.dataclass(frozen=True)
class Conversations(Sequence):
    """The conversations of a set of files, in memory, in file order.

    Attributes:
      files: the files read, in order.
      digest: of what was read (names caches of it).
    """

    items: list[Conversation]
    files: tuple[str, ...]
    digest: str

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index):
        return self.items[index]


def parse_record(row: Any, where: str = "") -> Conversation | str:
    """The conversation of a row (``messages``, or ``prompt`` and ``completion``), or
    the reason (one of :data:`REASONS`) it is not one."""
    if not isinstance(row, dict):
        return "not a JSON object"
    messages, train_from = row.get("messages"), 0
    prompt, completion = row.get("prompt"), row.get("completion")
    if "messages" not in row and isinstance(prompt, str) and isinstance(completion, str):
        prompt = [{"role": "user", "content": prompt}]
        completion = [{"role": "assistant", "content": completion}]
    if "messages" not in row and isinstance(prompt, list) and isinstance(completion, list):
        messages, train_from = prompt + completion, len(prompt)
    if not isinstance(messages, list):
        return "neither messages nor prompt and completion"
    if not messages:
        return "empty conversation"
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            return "message without a role"
        if message["role"] not in ROLES:
            return "unknown role"
        if not isinstance(message.get("content"), str):
            return "content not a string"
    answers = [i for i in range(train_from, len(messages)) if messages[i]["role"] == "assistant"]
    if not answers:
        return "no assistant message"
    if answers[0] == 0:  # no prompt to learn it from: its span would take the preamble in
        return "assistant message first"
    return Conversation(tuple(messages), train_from, where)


def iter_conversations(
    files: Sequence[epath.Path], key: str, skipped: corpus.Skipped, digest=None
) -> Iterator[Conversation]:
    """The conversations of ``files`` in order, streaming; damaged rows counted in
    ``skipped``; what was read fed to ``digest`` (a hashlib object), if given.

    Raises:
      ConfigError: naming ``key``, a file that yields no conversation, an unknown
        format, a damaged gzip file, or a Parquet file without the columns.
    """
    for path in files:
        kind, compressed = corpus.file_format(path, _FORMATS, key)
        if kind == "parquet":
            rows = _parquet_rows(path, key, digest)
        else:
            rows = (
                (f"{path.name}:{number}", *_json(raw))
                for number, raw in corpus.stream_lines(path, compressed, key, digest)
            )
        mine = corpus.Skipped(REASONS)
        count = 0
        for where, row, damage in rows:
            parsed = damage or parse_record(row, where)
            if isinstance(parsed, str):
                mine.add(parsed, where)
                continue
            count += 1
            yield parsed
        if not count:
            detail = f": {mine.describe()}" if mine.total else " (it is empty)"
            raise ConfigError(f"{key}: no usable conversation in {path}{detail}")
        for reason, n in mine.counts.items():
            skipped.counts[reason] += n
            skipped.first.setdefault(reason, mine.first[reason])


def read_conversations(patterns: Sequence[str] | str, key: str = "data.train_files"):
    """All the conversations of the files ``patterns`` name, in memory
    (:class:`Conversations`); damaged rows counted in one warning.

    Raises:
      ConfigError: as :func:`iter_conversations`, or no pattern, or one matching nothing.
    """
    files = corpus.expand(patterns, key)
    digest = hashlib.sha256(NAME.encode())
    skipped = corpus.Skipped(REASONS)
    items = list(iter_conversations(files, key, skipped, digest))
    skipped.warn(key, len(items), "conversations", corpus.describe_files(files))
    return Conversations(items, tuple(str(f) for f in files), digest.hexdigest()[:16])


def _json(raw: bytes) -> tuple[Any, str | None]:
    """``(row, None)``, or ``(None, why it is not JSON)``."""
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not a JSON object"


def _parquet_rows(path: epath.Path, key: str, digest) -> Iterator[tuple[str, Any, None]]:
    import pyarrow.parquet as pq  # noqa: PLC0415  (only for Parquet files)

    with path.open("rb") as f:
        try:
            parquet = pq.ParquetFile(f)
        except Exception as e:  # noqa: BLE001  (pyarrow's errors: not a Parquet file)
            raise ConfigError(f"{key}: {path} is not a Parquet file ({e})") from None
        names = parquet.schema_arrow.names
        columns = ["messages"] if "messages" in names else ["prompt", "completion"]
        if not set(columns) <= set(names):
            raise ConfigError(
                f"{key}: {path} has neither a 'messages' column nor 'prompt' and "
                f"'completion' (it has {names})"
            )
        number = 0
        for batch in parquet.iter_batches(columns=columns):
            for row in batch.to_pylist():
                number += 1
                if digest is not None:
                    digest.update(json.dumps(row, sort_keys=True, default=str).encode() + b"\0")
                yield f"{path.name}:row {number}", row, None


class ChatTokenizer(Protocol):
    """What a conversation's tokens need of a tokenizer: a
    :class:`~trainer.input.tokenizer.TextTokenizer` that also gives character offsets.

    Attributes:
      files: what a run keeps to load it again (name -> bytes); names the caches.
    """

    files: dict[str, bytes]

    def encode_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """The ids of ``text`` with no special token added, a special token's text
        becoming its id (as ``apply_chat_template`` tokenizes), and each token's
        ``[start, end)`` character offsets in ``text``."""


class ChatEncoder:
    """Conversations -> tokens and the loss's mask, by a template and a tokenizer
    (picklable, for input workers).

    Args:
      template: the model's chat template.
      tokenizer: the model's tokenizer (:class:`ChatTokenizer`).
      train_on_prompts: count every token, not only the answers' (``data.train_on_prompts``).
    """

    def __init__(
        self, template: chat_template.ChatTemplate, tokenizer: ChatTokenizer, train_on_prompts=False
    ):
        self.template, self.tokenizer = template, tokenizer
        self.train_on_prompts = train_on_prompts

    @property
    def digest(self) -> str:
        """Of what decides the tokens and masks (names caches of their counts)."""
        key = hashlib.sha256(self.template.digest.encode() + bytes([self.train_on_prompts]))
        for name in sorted(self.tokenizer.files):
            key.update(name.encode() + b"\0" + self.tokenizer.files[name])
        return key.hexdigest()[:12]

    def answer_spans(
        self, conversation: Conversation, what: str = "a conversation"
    ) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the ``[start, end)`` character span of each
        answer it learns (see the module docstring).

        Raises:
          ConfigError: naming ``what``, if the template fails on the conversation or
            on a prefix of it, or writes an answer differently in the whole.
        """
        messages = conversation.messages
        whole = self.template.render(messages, what=what)
        spans, cursor = [], 0
        for i in range(conversation.train_from, len(messages)):
            if messages[i]["role"] != "assistant":
                continue
            prompt = self.template.render(messages[:i], add_generation_prompt=True, what=what)
            turn = self.template.render(messages[: i + 1], what=what)
            if turn.startswith(prompt):
                start = len(prompt)
            else:  # the prompt is written otherwise once an answer follows (Mistral's system)
                start = self._answer_start(messages, i, turn, what)
            end = max(start, len(turn.rstrip()))
            if not whole.startswith(turn):  # nor are earlier turns once more follow
                found = whole.find(turn[start:end], cursor)
                if found < 0:
                    raise self._lost(i, what)
                start, end = found, found + end - start
            spans.append((start, end))
            cursor = end
        return whole, spans

    def _answer_start(self, messages, i: int, turn: str, what: str) -> int:
        """Where answer ``i`` begins in ``turn`` (its rendering with the messages before
        it): at its content, less the text the template writes before any answer's."""
        answer = {**messages[i], "content": chat_template.SENTINEL}
        probe = self.template.render([*messages[:i], answer], what=what)
        at = probe.find(chat_template.SENTINEL)
        if at < 0 or probe[:at] != turn[:at]:
            raise self._lost(i, what)
        before = self.template.answer_affixes[0]
        return at - len(before) if turn[:at].endswith(before) else at

    def _lost(self, i: int, what: str) -> ConfigError:
        return ConfigError(
            f"the chat template of {self.template.source} writes message {i} of {what} "
            "differently once more turns follow (e.g. it drops earlier answers' reasoning), "
            "so its tokens to learn cannot be found: split such conversations at each "
            "answer, or set data.train_on_prompts=True"
        )

    def encode(
        self, conversation: Conversation, what: str = "a conversation"
    ) -> tuple[np.ndarray, np.ndarray]:
        """``(ids, mask)``: int32 [tokens] ids equal to ``apply_chat_template(messages)``'s,
        and bool [tokens], True where the loss counts the token as a target (an answer's
        token; every token with ``train_on_prompts``).

        Raises:
          ConfigError: as :meth:`answer_spans`.
        """
        if self.train_on_prompts:
            text = self.template.render(conversation.messages, what=what)
            ids, _ = self.tokenizer.encode_offsets(text)
            return np.asarray(ids, np.int32), np.ones(len(ids), bool)
        text, spans = self.answer_spans(conversation, what)
        ids, offsets = self.tokenizer.encode_offsets(text)
        offsets = np.asarray(offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), bool)
        for start, end in spans:
            mask |= (offsets[:, 1] > start) & (offsets[:, 0] < end)
        return np.asarray(ids, np.int32), mask

    def prompt_ids(self, messages: Sequence[dict[str, Any]]) -> np.ndarray:
        """int32 ids of ``messages`` followed by the generation prompt: a generator's
        input, ``apply_chat_template(messages, add_generation_prompt=True)``'s ids."""
        text = self.template.render(messages, add_generation_prompt=True)
        return np.asarray(self.tokenizer.encode_offsets(text)[0], np.int32)


def _what(conversations: Conversations, index: int) -> str:
    return f"conversation {index} ({conversations[index].where})"


def conversation_lengths(
    cache_dir: str, conversations: Conversations, encoder: ChatEncoder
) -> np.ndarray:
    """int32 [conversations, 2]: each conversation's tokens and the tokens its loss
    counts, cached in ``cache_dir`` under the conversations' and the encoder's digests.
    Every conversation is rendered and its answers found here, once: a template that
    fails on one fails before training starts.

    Raises:
      ConfigError: as :meth:`ChatEncoder.answer_spans`, naming the conversation.
    """
    name = f"{NAME}_{conversations.digest}.{encoder.digest}.lengths.npy"

    def count(records):
        masks = [encoder.encode(c, _what(conversations, i))[1] for i, c in records]
        return [(len(m), int(m.sum())) for m in masks]

    return packing.token_lengths(
        storage.path(options.data_dir(cache_dir)) / name,
        len(conversations),
        lambda indices: [(i, conversations[i]) for i in indices],
        count,
        width=2,
    )


class ChatDocuments:
    """Conversations as a language model's documents (picklable): those of at most
    ``max_length`` tokens (the others counted in one warning), document ``j`` being
    conversation ``index[j]``; ``lengths`` [documents] their tokens.

    Args:
      counts: :func:`conversation_lengths`'s.
      key: the config key the files came from, for messages.

    Raises:
      ConfigError: no conversation fits ``max_length``, or none has a token to learn.
    """

    def __init__(
        self,
        conversations: Conversations,
        encoder: ChatEncoder,
        counts: np.ndarray,
        max_length: int,
        key: str = "data.train_files",
    ):
        fits = counts[:, 0] <= max_length
        if not fits.any():
            raise ConfigError(
                f"{key}: no conversation fits data.max_length={max_length} (the shortest "
                f"has {int(counts[:, 0].min()):,} tokens): raise data.max_length"
            )
        if not counts[fits, 1].any():
            raise ConfigError(f"{key}: the conversations that fit have no answer token to learn")
        too_long = f"longer than data.max_length={max_length}"
        skipped = corpus.Skipped((too_long,))
        for i in np.flatnonzero(~fits).tolist():
            skipped.add(too_long, f"{conversations[i].where}: {int(counts[i, 0]):,} tokens")
        names = corpus.describe_files(conversations.files)
        skipped.warn(key, int(fits.sum()), "conversations", names)
        self.conversations, self.encoder = conversations, encoder
        self.index = np.flatnonzero(fits)
        self.lengths = counts[self.index, 0].astype(np.int32)

    def tokens_and_masks(self, indices: Sequence[int]) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each document's ``(ids, mask)`` (:meth:`ChatEncoder.encode`)."""
        chosen = [int(self.index[int(j)]) for j in indices]
        return [
            self.encoder.encode(self.conversations[i], _what(self.conversations, i)) for i in chosen
        ]

    def tokens(self, indices: Sequence[int]) -> list[np.ndarray]:
        """Each document's ids (as :class:`~trainer.input.language.documents.TextDocuments`)."""
        return [ids for ids, _ in self.tokens_and_masks(indices)]
