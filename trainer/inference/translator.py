"""A trained translation model as a Python object: :class:`Translator`.

Load one from a run's work directory (a checkpoint's parameters; the optimizer
state is not read) or from an export (``python -m trainer.export``), then translate
a list of sentences or score pairs::

    from trainer import Translator

    model = Translator.load("/tmp/demo")           # or an export's directory
    model.translate(["the big dog sees a cat"])    # -> ["DET Dog big DET Cat sees"]
    model.score(["the dog"], ["DET Dog"])          # -> log-probabilities, one a pair

``python -m trainer.translate`` is this class over stdin and stdout. Sentences are
sorted by length and decoded ``batch_size`` at a time, split over the data-parallel
devices, their length padded to a power of two (one compiled program per length,
kept for the next call). Bad input costs its own line only (:func:`read_lines`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath

from trainer import console
from trainer.errors import ConfigError, UserError
from trainer.inference import loading
from trainer.input import translation as data_lib
from trainer.input.tokenizer import EOS_ID
from trainer.parallel import batches
from trainer.parallel import mesh as mesh_lib
from trainer.tasks import translation as task_lib
from trainer.workdir import storage


@dataclasses.dataclass(frozen=True)
class Report:
    """What a translation call did: checkpoint step, how many sentences were cut,
    compile and decode seconds, and the lines left empty (index, why)."""

    step: int
    sentences: int
    truncated: int
    compile_s: float
    decode_s: float
    skipped: tuple[tuple[int, str], ...] = ()


def read_lines(data: bytes) -> tuple[list[str | None], list[tuple[int, str]]]:
    """Input bytes -> one entry per line: the text, or None where a line is not
    UTF-8 text (with the reason, by line index): bad input costs its own line only.

    Lines end at ``\n`` alone (a ``\r`` before it is dropped): a lone ``\r``, which
    Python's ``splitlines`` would take for a line break, is a space inside its line,
    so the output keeps one line per input line whatever the bytes.
    """
    lines: list[str | None] = []
    problems = []
    body = data[:-1] if data.endswith(b"\n") else data
    for i, raw in enumerate(body.split(b"\n") if data else []):
        raw = raw.removesuffix(b"\r").replace(b"\r", b" ")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            lines.append(None)
            where = f"byte 0x{raw[e.start]:02x} at column {e.start}"
            problems.append((i, f"is not UTF-8 text ({where})"))
            continue
        if "\x00" in text:
            lines.append(None)
            problems.append((i, "has NUL bytes (binary input?)"))
            continue
        lines.append(text)
    return lines, problems


def require_translation_run(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError unless ``config`` is a translation (Transformer) run's."""
    loading.require_family(config, "transformer")


class Translator:
    """A trained Transformer with its tokenizer, on this process's devices.

    Attributes:
      config: the run's config (with any overrides the loader was given).
      step: the training step of the parameters (None for an export).
      source: where the parameters came from.
    """

    def __init__(self, trained: loading.Trained, vocab):
        self.config, self.step, self.source = trained.config, trained.step, trained.source
        self._model, self._params, self._vocab = trained.model, trained.params, vocab
        self._decoders: dict = {}  # (beam, max_length) -> jitted decoder
        self._compiled: dict = {}  # ((beam, max_length), batch shape) -> its executable
        self._log_probs = jax.jit(functools.partial(_log_probs, self._model.task.eval_model))

    @classmethod
    def load(
        cls,
        path: str | epath.PathLike,
        *,
        step: int | None = None,
        config: ml_collections.ConfigDict | None = None,
    ) -> Translator:
        """The model of a run's work directory (checkpoint ``step``, default the newest)
        or of an export (``python -m trainer.export --out PATH``).

        Args:
          config: the config to build the model with (default: the run's, or the
            export's); e.g. the run's with ``length_penalty`` changed.

        Raises:
          ConfigError: not a translation run, or a run of more than one process.
          CheckpointError: no such checkpoint, or it cannot be read.
          UserError: ``path`` is neither a work directory nor an export.
        """
        directory = storage.path(path)
        loading.check_step(step)
        config = loading.read_config(directory) if config is None else config
        require_translation_run(config)
        # The vocabulary first: a run without one fails before its parameters are read.
        vocab = data_lib.load_vocab(config.data, directory)
        return cls(loading.load(directory, family="transformer", step=step, config=config), vocab)

    # ------------------------------------------------------------ translate
    def translate(
        self,
        sentences: Sequence[str],
        *,
        beam_size: int | None = None,
        max_length: int | None = None,
        batch_size: int = 64,
    ) -> list[str]:
        """The translation of each sentence, in order ("" for an empty one).

        Args:
          beam_size: 1 decodes greedily (default: the run's ``eval_beam_size``).
          max_length: tokens per translation at most (default: ``max_decode_length``).
          batch_size: sentences decoded together (rounded up to the devices).

        Raises:
          UserError: ``sentences`` is one string, or holds something else than strings;
            ``beam_size``, ``max_length`` or ``batch_size`` is not an int of at least 1,
            or ``max_length`` is longer than the model takes (``model.max_len``).
        """
        return self.translate_with_report(
            sentences, beam_size=beam_size, max_length=max_length, batch_size=batch_size
        )[0]

    def translate_with_report(
        self,
        sentences: Sequence[str],
        *,
        beam_size: int | None = None,
        max_length: int | None = None,
        batch_size: int = 64,
    ) -> tuple[list[str], Report]:
        """:meth:`translate`, and a :class:`Report` of what it did."""
        sentences = loading.texts(sentences, "sentences")
        config = self.config
        beam = config.eval_beam_size if beam_size is None else beam_size
        max_length = config.max_decode_length if max_length is None else max_length
        checked = (("beam_size", beam), ("max_length", max_length), ("batch_size", batch_size))
        for name, value in checked:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name}={value!r:.40} must be an int of at least 1")
        if max_length > config.model.max_len:
            # The model takes at most max_len positions; a longer decode would grow its
            # beams' caches (17.9 GB at 100,000) for positions it was never trained on.
            raise UserError(
                f"max_length={max_length} is more than the model's positions, "
                f"model.max_len={config.model.max_len}: give at most {config.model.max_len}"
            )
        encoded, skipped, truncated = self._encode_all(sentences)
        todo = sorted(
            (i for i, t in enumerate(encoded) if t is not None), key=lambda i: -encoded[i].size
        )
        key = (beam, max_length)
        if key not in self._decoders:
            self._decoders[key] = task_lib.make_decoder(
                self._model.task.eval_model,
                beam_size=beam,
                max_decode_len=max_length,
                alpha=config.length_penalty,
            )
        decoder = self._decoders[key]
        padded = self._batches(todo, encoded, batch_size)
        out = [""] * len(sentences)
        with self._context():
            lengths = sorted({batch.shape for _, batch in padded})
            with console.phase(f"compiling the decoder for {len(lengths)} lengths") as compiling:
                compiled = {shape: self._executable(decoder, key, shape) for shape in lengths}
            start = time.perf_counter()
            with console.progress(
                total=len(todo), desc="translating", unit="sentences"
            ) as progress:
                for chunk, batch in padded:
                    tokens = compiled[batch.shape](self._params, self._put(batch))
                    for i, row in zip(chunk, np.asarray(tokens), strict=False):
                        out[i] = self._vocab.decode(row)
                    progress.update(len(chunk))
            decode_s = time.perf_counter() - start
        report = Report(
            self.step, len(todo), truncated, compiling.seconds, decode_s, tuple(skipped)
        )
        return out, report

    # ---------------------------------------------------------------- score
    def score(
        self, sources: Sequence[str], targets: Sequence[str], *, batch_size: int = 64
    ) -> np.ndarray:
        """float64 [n]: the natural-log probability of each target given its source
        (its tokens and EOS, teacher-forced, in ``eval_dtype``), both cut at the run's
        ``data.max_length`` tokens as in evaluation.

        Raises:
          UserError: the two lists differ in length, a sentence is empty, or an item
            is not a string.
        """
        sources, targets = loading.texts(sources, "sources"), loading.texts(targets, "targets")
        if len(sources) != len(targets):
            raise ConfigError(f"{len(sources)} sources but {len(targets)} targets")
        cap = self.config.data.max_length
        pairs = []
        for i, (source, target) in enumerate(zip(sources, targets, strict=True)):
            if not source.strip() or not target.strip():
                raise ConfigError(f"pair {i} has an empty side: nothing to score")
            pairs.append(
                (
                    _cut(_encode(self._vocab, source, cap), cap),
                    _cut(_encode(self._vocab, target, cap), cap),
                )
            )
        rows = self._rows(batch_size)
        out = np.zeros(len(pairs), np.float64)
        with self._context():
            for start in range(0, len(pairs), rows):
                chunk = pairs[start : start + rows]
                width = _bucket(max(max(s.size, t.size) for s, t in chunk), cap)
                inputs = np.zeros((rows, width), np.int32)
                outputs = np.zeros((rows, width), np.int32)
                for row, (s, t) in enumerate(chunk):
                    inputs[row, : s.size], outputs[row, : t.size] = s, t
                log_probs = self._log_probs(self._params, self._put(inputs), self._put(outputs))
                out[start : start + len(chunk)] = np.asarray(log_probs)[: len(chunk)]
        return out

    # -------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        with jax.set_mesh(self._model.mesh), nn.logical_axis_rules(self._model.rules):
            yield

    def _put(self, batch: np.ndarray) -> jax.Array:
        return jax.device_put(batch, batches.sharding(self._model.mesh))

    def _rows(self, batch_size: int) -> int:
        devices = mesh_lib.data_parallel_size(self._model.mesh)
        return -(-batch_size // devices) * devices

    def _encode_all(self, sentences: Sequence[str]):
        cap = self.config.data.max_length
        encoded: list[np.ndarray | None] = []
        skipped = []
        for i, text in enumerate(sentences):
            try:
                encoded.append(_encode(self._vocab, text, cap) if text.strip() else None)
            except Exception as e:  # noqa: BLE001  (whatever the tokenizer refuses costs one line)
                encoded.append(None)
                skipped.append((i, f"could not be tokenized ({type(e).__name__}: {e})"))
        truncated = sum(t is not None and t.size > cap for t in encoded)
        return [None if t is None else _cut(t, cap) for t in encoded], skipped, truncated

    def _batches(self, todo: list[int], encoded, batch_size: int):
        rows = self._rows(batch_size)
        cap = self.config.data.max_length
        padded = []
        for start in range(0, len(todo), rows):
            chunk = todo[start : start + rows]
            batch = np.zeros((rows, _bucket(encoded[chunk[0]].size, cap)), np.int32)
            for row, i in enumerate(chunk):
                batch[row, : encoded[i].size] = encoded[i]
            padded.append((chunk, batch))
        return padded

    def _executable(self, decoder, key, shape):
        if (key, shape) not in self._compiled:
            sharding = batches.sharding(self._model.mesh)
            spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
            self._compiled[key, shape] = decoder.lower(self._params, spec).compile()
        return self._compiled[key, shape]


def _log_probs(model, params, inputs, targets) -> jax.Array:
    """float32 [rows]: sum of log p(target token | source, earlier tokens), padding left out."""
    logits = model.apply({"params": params}, inputs, targets, train=False)
    log_p = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(targets > 0, picked, 0.0), axis=-1)


def _cut(tokens: np.ndarray, cap: int) -> np.ndarray:
    """At most ``cap`` tokens, the last one EOS (as evaluation truncates)."""
    return tokens if tokens.size <= cap else np.append(tokens[: cap - 1], np.int32(EOS_ID))


def _encode(vocab, text: str, cap: int) -> np.ndarray:
    # A SentencePiece piece is at most 16 characters: the first cap tokens of a
    # very long line come from its first 64 * cap characters; encode no more.
    return np.asarray(vocab.encode(text[: 64 * cap]), np.int32)


def _bucket(length: int, cap: int) -> int:
    """The padded length: the next power of two (at least 8), at most ``cap``."""
    return min(cap, max(8, 1 << (length - 1).bit_length()))
