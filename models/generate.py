"""Text generation with a decoder's key/value cache: greedy, or sampled with a temperature,
top-k and top-p.

Prompts of different lengths share a batch left-padded: every row's prompt ends in the
same column, so each step writes one cache slot for all rows, and a row's padding is
masked out of every attention (its positions start at 0 at its first token, as in
training). The prompt is run once (prefill), then one token a step until
``max_new_tokens`` or every row has ended (EOS).

Each row draws from its own key, ``fold_in(fold_in(seed key, row), step)``: a prompt's
sample does not depend on the other prompts of its batch, nor on how the batch is
split over devices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from models import decoder

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: 0 takes the most likely token (greedy); else logits / temperature.
      top_k: keep the k most likely tokens (0: all).
      top_p: keep the most likely tokens whose probabilities add up to p (1: all).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0


def choose(logits: Array, keys: Array, sampling: Sampling) -> Array:
    """int32 [batch]: the next token of each row from float32 [batch, vocab] logits,
    with one key per row."""
    if sampling.temperature <= 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    lowest = jnp.finfo(logits.dtype).min
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, lowest, logits)
    if sampling.top_p < 1.0:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        # The smallest set whose probability reaches top_p: tokens whose preceding mass
        # is still below it (the most likely token always stays).
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(before < sampling.top_p, ordered, jnp.inf), axis=-1)
        logits = jnp.where(logits < cutoff[:, None], lowest, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def generate(
    model: decoder.Decoder,
    params,
    prompts: Array,
    pad: Array,
    *,
    max_new_tokens: int,
    eos_id: int | Sequence[int],
    sampling: Sampling,
    seed: Array,
    rows: Array,
) -> Array:
    """The continuation of each prompt, int32 [batch, max_new_tokens]: the tokens up
    to and including the first EOS, then the first EOS id again (to be cut there).

    Args:
      model: the decoder with ``config.decode`` True.
      params: its parameters.
      prompts: int [batch, prompt_len], each row's prompt at its end (left-padded).
      pad: int [batch]: each row's padding columns.
      max_new_tokens: tokens to generate at most.
      eos_id: ends a row: an id, or several (a model may stop at any of a list, as
        Llama 3 Instruct's ``generation_config.json`` says); none: rows run to the end
        (padded with -1, which no token is).
      sampling: how to choose each token.
      seed: a PRNG key.
      rows: int [batch]: each row's index among the caller's prompts (its key).
    """
    batch, prompt_len = prompts.shape
    stops = tuple(eos_id) if isinstance(eos_id, Sequence) else (eos_id,)
    fill = stops[0] if stops else -1
    stop_ids = jnp.asarray(stops or (-1,), jnp.int32)
    slots = prompt_len + max_new_tokens
    shapes = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((batch, slots), jnp.int32))
    )
    cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes["cache"])
    slot = jnp.arange(slots)
    row_keys = jax.vmap(lambda r: jax.random.fold_in(seed, r))(rows)

    def run(cache, tokens, first: int | Array, length: int):
        # Query i of this block sits in slot first + i; it sees its row's slots from the
        # prompt's first token up to itself.
        query = first + jnp.arange(length)
        visible = (slot[None, None, :] >= pad[:, None, None]) & (
            slot[None, None, :] <= query[None, :, None]
        )
        if model.config.sliding_window:
            visible &= slot[None, None, :] > query[None, :, None] - model.config.sliding_window
        positions = query[None, :] - pad[:, None]
        logits, updated = model.apply(
            {"params": params, "cache": cache},
            tokens,
            positions=jnp.maximum(positions, 0),
            mask=visible[:, None, None],
            mutable=["cache"],
        )
        return logits[:, -1], updated["cache"]

    logits, cache = run(cache, prompts, 0, prompt_len)
    out = jnp.full((batch, max_new_tokens), fill, jnp.int32)

    def step(carry):
        i, cache, logits, out, done = carry
        keys = jax.vmap(lambda k: jax.random.fold_in(k, i))(row_keys)
        token = jnp.where(done, fill, choose(logits, keys, sampling))
        out = out.at[:, i].set(token)
        done = done | jnp.isin(token, stop_ids)
        logits, cache = run(cache, token[:, None], prompt_len + i, 1)
        return i + 1, cache, logits, out, done

    def going(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    done = jnp.zeros((batch,), bool)
    _, _, _, out, _ = jax.lax.while_loop(going, step, (0, cache, logits, out, done))
    return out


def until_stop(ids: Sequence[int], stops: Sequence[int]) -> list[int]:
    """A row of :func:`generate`'s output up to its first stop id (or -1, what a row is
    padded with when there are no stop ids)."""
    out = []
    for token in ids:
        if token in stops or token < 0:
            break
        out.append(int(token))
    return out
