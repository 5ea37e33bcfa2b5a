"""A trained language model as a Python object: :class:`Generator`.

Load one from a run's work directory (a checkpoint's parameters; the optimizer state
is not read), from an export (``python -m trainer.export``) or from a Hugging Face
model directory, then continue prompts::

    from trainer import Generator

    model = Generator.load("/tmp/lm")       # or an export's directory
    model.generate(["the big dog sees a cat =>"], max_new_tokens=24)
    model.generate(prompts, temperature=0.8, top_p=0.95, seed=1)   # sampled
    model.generate([[{"role": "user", "content": "What is 2 + 3?"}]], chat=True)

With ``chat=True`` each prompt is a conversation (a list of ``{"role", "content"}``
messages, or a string: one user message), rendered with the model's chat template (a
run's kept ``chat_template.jinja``, the model directory's ``tokenizer_config.json``'s,
or :data:`trainer.input.chat_template.FALLBACK`) and its generation prompt, exactly as
``transformers``' ``apply_chat_template(..., add_generation_prompt=True)``; the answer
ends at the template's end of turn as well as at EOS.

``python -m trainer.generate`` is this class over stdin and stdout. Prompts are
tokenized (``BOS`` first where the tokenizer adds one, as ``transformers`` does),
sorted by length and run ``batch_size`` at a time, all left-padded to one width (a
power of two, at least :data:`MIN_WIDTH`: prompts of up to 64 tokens share one
compiled program, kept for the next call) and split over the data-parallel devices.
A row ends at any of the tokenizer's stop ids (``generation_config.json``'s EOS list
where the model has one).

Every argument is checked before anything runs: its type (an int where a count is
meant: ``4.5`` or ``"4"`` is refused, not rounded or compared as text), its range
(a finite temperature, ``top_k`` within the vocabulary, ``max_new_tokens`` within the
context), each with one :class:`~trainer.errors.UserError` naming it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers
import os
import time
from collections.abc import Iterator, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from etils import epath

from models import decoder, generate
from trainer import console, tasks
from trainer.errors import UserError
from trainer.inference import loading
from trainer.input import chat_template as chat_template_lib
from trainer.input import tokenizer as tokenizer_lib
from trainer.parallel import batches
from trainer.parallel import mesh as mesh_lib
from trainer.tasks import language_model
from trainer.workdir import storage


@dataclasses.dataclass(frozen=True)
class Report:
    """What a generation call did: checkpoint step, prompts, tokens generated, and the
    seconds spent compiling and generating."""

    step: int | None
    prompts: int
    tokens: int
    compile_s: float
    generate_s: float

    @property
    def tokens_per_sec(self) -> float:
        return self.tokens / max(self.generate_s, 1e-9)


MIN_WIDTH = 64  # the narrowest prompt program: one compile for all short prompts
# jax.random.PRNGKey keeps a seed's low 32 bits (without x64): 2**32 would be seed 0.
_SEEDS = 2**32


class Generator:
    """A trained decoder with its tokenizer, on this process's devices.

    Attributes:
      config: the run's config; step: the checkpoint's step (None for an export);
      source: where the parameters came from; tokenizer: the run's tokenizer.
    """

    def __init__(
        self,
        trained: loading.Trained,
        tokenizer: tokenizer_lib.TextTokenizer,
        files: dict[str, bytes] | None = None,
    ):
        self.config, self.step, self.source = trained.config, trained.step, trained.source
        self.tokenizer = tokenizer
        self._files = dict(files or tokenizer.files)
        self._trained = trained
        cfg = language_model.model_config(trained.config)
        eval_dtype = jnp.dtype(trained.config.eval_dtype)
        self._model = decoder.Decoder(dataclasses.replace(cfg, decode=True, dtype=eval_dtype))
        self.max_len = cfg.max_len
        self.vocab_size = cfg.vocab_size
        self._compiled: dict = {}

    @classmethod
    def load(
        cls,
        path: str | epath.PathLike,
        *,
        step: int | None = None,
        config: ml_collections.ConfigDict | None = None,
    ) -> Generator:
        """The model of a run's work directory (checkpoint ``step``, default the newest),
        of an export or of a Hugging Face model directory.

        Raises:
          ConfigError: not a decoder, or a run of more than one process.
          CheckpointError: no such checkpoint, or it cannot be read.
          UserError: ``path`` is none of these (a file, say), or ``step`` is not an int.
        """
        if isinstance(path, str | bytes) and not path:
            raise UserError("Generator.load: the path is empty: give a run's work directory")
        if not isinstance(path, str | os.PathLike):
            raise UserError(
                f"Generator.load: {type(path).__name__} {path!r:.40} is not a path: give a "
                "run's work directory, an export or a Hugging Face model directory"
            )
        directory = storage.path(path)
        loading.check_step(step)
        config = loading.read_config(directory) if config is None else config
        loading.require_family(config, "decoder")
        files = {
            name: (directory / name).read_bytes()
            for name in tasks.run_file_names(config)
            if (directory / name).exists()
        }
        tokenizer = tokenizer_lib.tokenizer_from_files(files, str(directory))
        trained = loading.load(directory, family="decoder", step=step, config=config)
        return cls(trained, tokenizer, files)

    @functools.cached_property
    def chat_template(self) -> chat_template_lib.ChatTemplate:
        """The template conversations are rendered with (the module doc)."""
        specials = chat_template_lib.tokenizer_specials(self.tokenizer)
        return chat_template_lib.template_from_files(self._files, self.source, specials)

    def generate(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        batch_size: int = 16,
        chat: bool = False,
    ) -> list[str]:
        """The continuation of each prompt, in order (up to EOS, which is left out).

        Args:
          max_new_tokens: tokens to generate at most per prompt.
          temperature: 0 (the default) is greedy; else sampled at this temperature.
          top_k: sample from the k most likely tokens only (0: all).
          top_p: sample from the most likely tokens whose probabilities reach p (1: all).
          seed: of the samples: the same seed gives the same continuations.
          batch_size: prompts generated together (rounded up to the devices).
          chat: each prompt is a conversation, answered (the module doc).

        Raises:
          UserError: ``prompts`` is one string (or a file) or holds something else than
            strings (conversations, with ``chat``), a prompt does not fit the model's
            context with ``max_new_tokens``, or an argument of another type than its
            default's or out of range.
          ConfigError: the chat template fails on a conversation.
        """
        return self.generate_with_report(
            prompts,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
            chat=chat,
        )[0]

    def generate_with_report(
        self,
        prompts: Sequence[str],
        *,
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        batch_size: int = 16,
        chat: bool = False,
    ) -> tuple[list[str], Report]:
        """:meth:`generate`, and a :class:`Report` of what it did."""
        prompts = _conversations(prompts) if chat else loading.texts(prompts, "prompts")
        sampling = check_arguments(
            self.config.model,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            batch_size=batch_size,
        )
        if chat:
            encoded = [self._encode_chat(i, p, max_new_tokens) for i, p in enumerate(prompts)]
            stops = chat_template_lib.stop_ids(self.chat_template, self.tokenizer)
        else:
            encoded = [self._encode(i, p, max_new_tokens) for i, p in enumerate(prompts)]
            stops = tuple(self.tokenizer.stop_ids)
        order = sorted(range(len(prompts)), key=lambda i: -len(encoded[i]))
        rows = self._rows(batch_size)
        # One width for the call: the longest prompt's (its chunks share one program).
        longest = max((len(ids) for ids in encoded), default=1)
        width = min(_bucket(longest), self.max_len - max_new_tokens)
        out: list[str] = [""] * len(prompts)
        produced, compile_s = 0, 0.0
        start = time.perf_counter()
        with (
            self._context(),
            console.progress(total=len(prompts), desc="generating", unit="prompts") as progress,
        ):
            for first in range(0, len(order), rows):
                chunk = order[first : first + rows]
                tokens, pad, index = _left_padded([encoded[i] for i in chunk], chunk, rows, width)
                before = time.perf_counter()
                program = self._program(rows, width, max_new_tokens, sampling, stops)
                compile_s += time.perf_counter() - before
                result = np.asarray(
                    program(
                        self._trained.params,
                        *(self._put(a) for a in (tokens, pad, index)),
                        jax.random.PRNGKey(seed),
                    )
                )
                for r, i in enumerate(chunk):
                    ids = generate.until_stop(result[r].tolist(), stops)
                    produced += len(ids)
                    out[i] = self.tokenizer.decode(ids)
                progress.update(len(chunk))
        seconds = time.perf_counter() - start - compile_s
        return out, Report(self.step, len(prompts), produced, compile_s, seconds)

    # -------------------------------------------------------------- helpers
    def _encode_chat(self, index: int, messages: list, max_new_tokens: int) -> list[int]:
        text = self.chat_template.render(
            messages, add_generation_prompt=True, what=f"conversation {index}"
        )
        ids = list(self.tokenizer.encode_offsets(text)[0])
        return self._fits(index, ids, max_new_tokens)

    def _encode(self, index: int, prompt: str, max_new_tokens: int) -> list[int]:
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        ids = bos + self.tokenizer.encode(prompt)
        if not ids:
            raise UserError(
                f"prompt {index} is empty and the tokenizer adds no BOS: nothing to continue"
            )
        return self._fits(index, ids, max_new_tokens)

    def _fits(self, index: int, ids: list[int], max_new_tokens: int) -> list[int]:
        if len(ids) + max_new_tokens > self.max_len:
            raise UserError(
                f"prompt {index} has {len(ids)} tokens: with max_new_tokens={max_new_tokens} "
                f"that is more than the model's context, model.max_len={self.max_len} "
                f"(at most {self.max_len - max_new_tokens} prompt tokens)"
            )
        return ids

    @contextlib.contextmanager
    def _context(self) -> Iterator[None]:
        model = self._trained.model
        with jax.set_mesh(model.mesh), nn.logical_axis_rules(model.rules):
            yield

    def _rows(self, batch_size: int) -> int:
        devices = mesh_lib.data_parallel_size(self._trained.model.mesh)
        return -(-batch_size // devices) * devices

    def _put(self, array: np.ndarray) -> jax.Array:
        return jax.device_put(array, batches.sharding(self._trained.model.mesh))

    def _program(
        self,
        rows: int,
        width: int,
        max_new_tokens: int,
        sampling: generate.Sampling,
        stops: tuple[int, ...],
    ):
        key = (rows, width, max_new_tokens, sampling, stops)
        if key not in self._compiled:
            fn = jax.jit(
                functools.partial(
                    generate.generate,
                    self._model,
                    max_new_tokens=max_new_tokens,
                    eos_id=stops,
                    sampling=sampling,
                )
            )
            sharding = batches.sharding(self._trained.model.mesh)
            specs = [
                jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
                for shape in ((rows, width), (rows,), (rows,))
            ]
            with console.phase(f"compiling the generator for prompts of {width} tokens"):
                lowered = fn.lower(
                    self._trained.params,
                    specs[0],
                    specs[1],
                    seed=jax.random.PRNGKey(0),
                    rows=specs[2],
                )
                self._compiled[key] = lowered.compile()
        compiled = self._compiled[key]
        return lambda params, tokens, pad, index, seed: compiled(
            params, tokens, pad, seed=seed, rows=index
        )


def check_arguments(
    model: ml_collections.ConfigDict,
    *,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    batch_size,
) -> generate.Sampling:
    """The sampling settings of :meth:`Generator.generate`'s arguments for the decoder
    ``model`` (``config.model``), each checked (the module docstring): a command checks
    its flags with it before it reads its input.

    Raises:
      UserError: naming the first argument of a wrong type or out of range.
    """
    max_len, vocab_size = model.max_len, model.vocab_size
    _integer("max_new_tokens", max_new_tokens, 1)
    if max_new_tokens >= max_len:
        raise UserError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the model's "
            f"context, model.max_len={max_len}: give at most {max_len - 1}"
        )
    _integer("batch_size", batch_size, 1)
    _real("temperature", temperature, "0 (greedy) or more")
    if temperature < 0:
        raise UserError(f"temperature={temperature} must be 0 (greedy) or more")
    _integer("top_k", top_k, 0)
    if top_k > vocab_size:
        raise UserError(
            f"top_k={top_k} is more than the model's {vocab_size} ids: give at most "
            f"{vocab_size} (0: all)"
        )
    _real("top_p", top_p, "in (0, 1]")
    if not 0 < top_p <= 1:
        raise UserError(f"top_p={top_p} must be in (0, 1] (1: all tokens)")
    _integer("seed", seed, 0)
    if seed >= _SEEDS:
        raise UserError(
            f"seed={seed} is too large: give one below 2**32 (larger seeds would repeat "
            "smaller ones' samples)"
        )
    return generate.Sampling(float(temperature), int(top_k), float(top_p))


def _integer(name: str, value, low: int) -> None:
    """Raises UserError unless ``value`` is an int (not a bool) of at least ``low``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise UserError(
            f"{name}={value!r:.40} is {type(value).__name__}: give an int of at least {low}"
        )
    if value < low:
        raise UserError(f"{name}={value} must be at least {low}")


def _real(name: str, value, expected: str) -> None:
    """Raises UserError unless ``value`` is a finite real number (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UserError(f"{name}={value!r:.40} is {type(value).__name__}: give a number {expected}")
    if not math.isfinite(value):
        raise UserError(f"{name}={value} is not a finite number: give one {expected}")


def _conversations(prompts) -> list[list[dict]]:
    """``prompts`` as conversations: each a list of ``{"role", "content"}`` messages, or
    a string (one user message).

    Raises:
      UserError: anything else, naming the prompt.
    """
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Sequence):
        raise UserError(
            "prompts: give a list of conversations (each a list of {'role', 'content'} "
            "messages, or a string: one user message)"
        )
    out = []
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        ok = (
            isinstance(prompt, Sequence)
            and prompt
            and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                for m in prompt
            )
        )
        if not ok:
            raise UserError(
                f"prompt {i}: a conversation is a non-empty list of {{'role', 'content'}} "
                f"messages (or a string), not {type(prompt).__name__} {prompt!r:.60}"
            )
        out.append([dict(m) for m in prompt])
    return out


def _bucket(length: int) -> int:
    """The padded prompt length: the next power of two, at least :data:`MIN_WIDTH`."""
    return max(MIN_WIDTH, 1 << (length - 1).bit_length())


def _left_padded(prompts: list[list[int]], indices: list[int], rows: int, width: int):
    """``(tokens, pad, index)``: the prompts at the right of [rows, width] int32 (rows
    past the prompts are padding rows of one token), how much each row is padded, and
    each row's index among the caller's prompts."""
    tokens = np.zeros((rows, width), np.int32)
    pad = np.full((rows,), width - 1, np.int32)
    index = np.zeros((rows,), np.int32)
    for r, (ids, i) in enumerate(zip(prompts, indices, strict=True)):
        tokens[r, width - len(ids) :] = ids
        pad[r], index[r] = width - len(ids), i
    return tokens, pad, index
