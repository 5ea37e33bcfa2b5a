"""What a language model has learnt, shown beside its eval metrics: the greedy
continuation of a few held-out documents' beginnings (a decoder), or its guesses at
a held-out row's masked tokens (BERT). The same lines on every process, in the log
and in TensorBoard, at every evaluation."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from models import generate
from trainer.tasks.base import HostEvaluation

# Tokens a sample continuation has at most.
NEW_TOKENS = 16


def continuations(
    model,
    tokenizer,
    pairs: Sequence[tuple[np.ndarray, np.ndarray]],
    *,
    stop_ids: Sequence[int],
    new_tokens: int = NEW_TOKENS,
) -> Callable[..., HostEvaluation]:
    """``evaluate_extra(variables, to_global, to_local)``: the greedy continuation of
    each prompt of ``pairs`` by ``model`` (a decoder with ``decode`` set), with the
    held-out continuation beside it.

    Args:
      model: the decoder, in its evaluation dtype, with a decoding cache.
      tokenizer: decodes ids to text.
      pairs: ``(prompt ids, held-out continuation ids)``: a document's beginning and
        what follows (``documents.document_prompts``), or a conversation up to its last
        answer, with the generation prompt, and that answer.
      stop_ids: the ids that end a continuation (EOS, a chat template's end of turn).
      new_tokens: tokens to generate at most.
    """
    prompts = [np.asarray(p) for p, _ in pairs]
    width = max((len(p) for p in prompts), default=1)

    @functools.cache
    def program():
        return jax.jit(
            functools.partial(
                generate.generate,
                model,
                max_new_tokens=new_tokens,
                eos_id=tuple(stop_ids),
                sampling=generate.Sampling(),
            )
        )

    def evaluate(variables, to_global, to_local) -> HostEvaluation:
        del to_local
        if not prompts:
            return HostEvaluation({})
        # One row a device (a multiple of the data-parallel size), the prompts repeated
        # to fill them; each process hands its block of the rows.
        rows = max(jax.device_count(), len(prompts))
        rows += -rows % jax.device_count()
        tokens = np.zeros((rows, width), np.int32)
        pad = np.zeros((rows,), np.int32)
        for r in range(rows):
            prompt = prompts[r % len(prompts)]
            tokens[r, width - len(prompt) :] = prompt
            pad[r] = width - len(prompt)
        block = rows // jax.process_count()
        mine = slice(jax.process_index() * block, (jax.process_index() + 1) * block)
        local = {"tokens": tokens[mine], "pad": pad[mine], "rows": np.arange(rows)[mine]}
        batch = to_global(local)
        out = program()(
            variables["params"],
            batch["tokens"],
            batch["pad"],
            seed=jax.random.PRNGKey(0),
            rows=batch["rows"],
        )
        out = np.asarray(multihost_utils.process_allgather(out, tiled=True))
        samples = []
        for r, (prompt, held_out) in enumerate(pairs):
            new = generate.until_stop(out[r].tolist(), stop_ids)
            held_out = generate.until_stop(np.asarray(held_out).tolist(), stop_ids)
            samples.append(
                f"{_text(tokenizer, prompt)} => {_text(tokenizer, new)} "
                f"(held out: {_text(tokenizer, held_out)})"
            )
        return HostEvaluation({}, tuple(samples))

    return evaluate


def masked_guesses(
    model, tokenizer, batch_of: Callable[[], dict], arguments: Callable[[dict], tuple], rows: int
) -> Callable[..., HostEvaluation]:
    """``evaluate_extra(variables, to_global, to_local)``: BERT's guesses at the masked
    tokens of the first ``rows`` rows of an eval batch (``batch_of()``), each row's
    text with its masked tokens as ``[guess/truth]``.

    Args:
      model: BERT in its evaluation dtype.
      tokenizer: decodes ids to text.
      batch_of: this process's first eval batch.
      arguments: a batch -> the model's positional arguments.
      rows: how many rows to show.
    """

    @functools.cache
    def predict():
        return jax.jit(
            lambda variables, batch: jnp.argmax(
                model.apply(variables, *arguments(batch), train=False), axis=-1
            )
        )

    def evaluate(variables, to_global, to_local) -> HostEvaluation:
        del to_local
        local = batch_of()
        if local is None:
            return HostEvaluation({})
        guesses = predict()(variables, to_global(local))
        guesses = np.asarray(multihost_utils.process_allgather(guesses, tiled=True))
        keys = ("inputs", "segmentation", "masked_positions", "masked_ids", "masked_weights")
        batch = {
            k: np.asarray(multihost_utils.process_allgather(local[k], tiled=True)) for k in keys
        }
        samples = []
        for r in range(min(rows, len(guesses))):
            if not batch["masked_weights"][r].any():
                continue
            samples.append(_with_guesses(tokenizer, batch, guesses, r))
        return HostEvaluation({}, tuple(samples))

    return evaluate


def _with_guesses(tokenizer, batch: dict, guesses: np.ndarray, row: int) -> str:
    """Row ``row``'s first document with each masked token as ``[guess/truth]``."""
    segments = batch["segmentation"][row]
    first = segments == segments[segments > 0].min() if (segments > 0).any() else segments > 0
    ids = batch["inputs"][row].tolist()
    marks = {}
    for position, truth, guess, weight in zip(
        batch["masked_positions"][row],
        batch["masked_ids"][row],
        guesses[row],
        batch["masked_weights"][row],
        strict=True,
    ):
        if weight:
            marks[int(position)] = (int(guess), int(truth))
    words, run = [], []
    for position, token in enumerate(ids):
        if not first[position]:
            continue
        if position in marks:
            if run:
                words.append(_text(tokenizer, run))
                run = []
            guess, truth = marks[position]
            words.append(f"[{_text(tokenizer, [guess])}/{_text(tokenizer, [truth])}]")
        else:
            run.append(token)
    if run:
        words.append(_text(tokenizer, run))
    return " ".join(w for w in words if w)


def _text(tokenizer, ids) -> str:
    """``ids`` as text, BOS and EOS left out, on one line."""
    specials = {tokenizer.bos_id, tokenizer.eos_id} - {None}
    return " ".join(tokenizer.decode([int(i) for i in ids if int(i) not in specials]).split())
