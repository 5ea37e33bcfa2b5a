"""Translating sentences with a run's checkpoint (``python -m trainer.translate``).

One source sentence a line in, its translation a line out (empty lines stay
empty), with the run's own tokenizer and the parameters of one checkpoint; no
optimizer is built. Bad input costs its own line only (:func:`read_lines`).
Sentences are sorted by length and decoded ``batch_size`` at a time, split over
the data-parallel devices, their length padded to a power of two (one compiled
program per length).
"""

from __future__ import annotations

import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainer.data import translation as data_lib
from trainer.data.tokenizer import EOS_ID
from trainer.parallel import batches
from trainer.parallel import mesh as mesh_lib
from trainer.runtime import console
from trainer.runtime.errors import ConfigError
from trainer.tasks import translation as task_lib
from trainer.training import evaluation
from trainer.training import experiment as experiment_lib


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


def require_translation_run(config) -> None:
    """Raises ConfigError unless ``config`` is a translation (Transformer) run's."""
    if config.model.name != "transformer":
        raise ConfigError(
            f"this is a run of model.name='{config.model.name}', not a translation model: "
            "only a Transformer run (configs/transformer_*.py) translates"
        )


def _encode(vocab, text: str, cap: int) -> np.ndarray:
    # A SentencePiece piece is at most 16 characters: the first cap tokens of a
    # very long line come from its first 64 * cap characters; encode no more.
    return np.asarray(vocab.encode(text[: 64 * cap]), np.int32)


def _bucket(length: int, cap: int) -> int:
    """The padded length: the next power of two (at least 8), at most ``cap``."""
    return min(cap, max(8, 1 << (length - 1).bit_length()))


def translate(
    config,
    workdir: str,
    sentences: list[str],
    *,
    step: int | None = None,
    beam_size: int,
    max_length: int,
    batch_size: int,
) -> tuple[list[str], Report]:
    """Translates ``sentences`` with checkpoint ``step`` (default newest) of ``workdir``.

    Returns:
      The translations, in order, and a :class:`Report`.

    Raises:
      ConfigError: not a translation run, more than one process, bad sizes.
      CheckpointError: no such checkpoint, or it cannot be read.
    """
    require_translation_run(config)
    if jax.process_count() > 1:
        raise ConfigError("trainer.translate runs as one process (it reads stdin)")
    if batch_size < 1 or max_length < 1:
        raise ConfigError(f"--batch_size={batch_size} and --max_length={max_length} must be >= 1")
    model = experiment_lib.build_model(config, with_data=False)
    vocab = data_lib.load_vocab(config.data)
    with console.phase(f"reading the parameters of {workdir}"):
        step, variables = evaluation.restore_variables(model, workdir, step)
    params = variables["params"]
    decoder = task_lib.make_decoder(
        model.task.eval_model,
        beam_size=beam_size,
        max_decode_len=max_length,
        alpha=config.length_penalty,
    )

    cap = config.data.max_length
    encoded: list[np.ndarray | None] = []
    skipped = []
    for i, text in enumerate(sentences):
        try:
            encoded.append(_encode(vocab, text, cap) if text.strip() else None)
        except Exception as e:  # noqa: BLE001  (whatever the tokenizer refuses costs one line)
            encoded.append(None)
            skipped.append((i, f"could not be tokenized ({type(e).__name__}: {e})"))
    truncated = sum(t is not None and t.size > cap for t in encoded)
    encoded = [
        t if t is None or t.size <= cap else np.append(t[: cap - 1], EOS_ID) for t in encoded
    ]
    todo = sorted(
        (i for i, t in enumerate(encoded) if t is not None), key=lambda i: -encoded[i].size
    )
    devices = mesh_lib.data_parallel_size(model.mesh)
    rows = -(-batch_size // devices) * devices
    sharding = batches.sharding(model.mesh)
    padded = []
    for start in range(0, len(todo), rows):
        chunk = todo[start : start + rows]
        batch = np.zeros((rows, _bucket(encoded[chunk[0]].size, cap)), np.int32)
        for row, i in enumerate(chunk):
            batch[row, : encoded[i].size] = encoded[i]
        padded.append((chunk, batch))

    with jax.set_mesh(model.mesh), nn.logical_axis_rules(model.rules):
        compiled = {}
        lengths = sorted({batch.shape for _, batch in padded})
        with console.phase(f"compiling the decoder for {len(lengths)} lengths") as compiling:
            for shape in lengths:
                spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
                compiled[shape] = decoder.lower(params, spec).compile()
        start = time.perf_counter()
        out = [""] * len(sentences)
        with console.progress(total=len(todo), desc="translating", unit="sentences") as progress:
            for chunk, batch in padded:
                tokens = compiled[batch.shape](params, jax.device_put(batch, sharding))
                for i, row in zip(chunk, np.asarray(tokens), strict=False):
                    out[i] = vocab.decode(row)
                progress.update(len(chunk))
        decode_s = time.perf_counter() - start
        compile_s = compiling.seconds
    return out, Report(step, len(todo), truncated, compile_s, decode_s, tuple(skipped))
