"""Beam search with the GNMT length penalty, over any step function with a cache.

Vaswani et al. (2017) decode WMT with beam 4 and length penalty alpha = 0.6, the
penalty of Wu et al. (2016, GNMT, eq. 14): a finished hypothesis Y scores

    log P(Y | X) / lp(|Y|),   lp(n) = ((5 + n) / 6) ** alpha,

where |Y| counts its tokens, EOS included. alpha = 0 ranks by log-probability
alone; larger alphas favour longer outputs.

The search is model-agnostic: it calls ``step_fn(cache, tokens, index)`` for the
logits of the next token of every hypothesis (``models/decode.py`` wires the
Transformer's key/value cache to it). Hypotheses live in a flat ``[batch * beam]``
dim (beam-major within each batch row), so a model sees an ordinary batch; after
each step the rows of every cache leaf with that dim (leading, or at ``cache_axis``:
a stack of layers' caches is ``[layers, rows, ...]``) are reordered to follow their
hypotheses. Other leaves (the cache index) are shared.

Per step, for each batch row: the ``beam`` live hypotheses are extended by every
token; the ``2 * beam`` best extensions are kept (at most ``beam`` of them end in
EOS, so at least ``beam`` stay alive); those ending in EOS are scored and merged
into the ``beam`` best finished ones, the others become the new live ones. A row
is done when its ``beam`` finished slots are full and no live hypothesis can still
beat the worst of them: log-probabilities only fall as a hypothesis grows, and
with alpha >= 0 the best a live one can reach is its log-probability divided by
``lp(max_len)``. The padding id is never emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

# Finite stand-in for -inf: sums and divisions of it stay ordered and NaN-free.
NEG_INF = -1.0e7


def length_penalty(length: jax.Array | int, alpha: float) -> jax.Array:
    """GNMT's ``((5 + length) / 6) ** alpha``; 1 for a one-token output."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


class _State(NamedTuple):
    index: jax.Array  # int32 scalar: tokens decoded so far
    cache: Any  # the step function's cache, rows [batch * beam, ...]
    alive_seqs: jax.Array  # int32 [batch, beam, max_len]
    alive_logp: jax.Array  # float32 [batch, beam], sorted best first
    done_seqs: jax.Array  # int32 [batch, beam, max_len]
    done_scores: jax.Array  # float32 [batch, beam], sorted best first; NEG_INF = empty slot
    done_flags: jax.Array  # bool [batch, beam]


def _gather_beams(x: jax.Array, beams: jax.Array) -> jax.Array:
    """``x[b, beams[b, j]]`` for x [batch, old_beam, ...] and int beams [batch, new_beam]."""
    index = beams.reshape(*beams.shape, *([1] * (x.ndim - 2)))
    return jnp.take_along_axis(x, index, axis=1)


def _reorder_cache(cache: Any, beams: jax.Array, axis: int = 0) -> Any:
    """Moves the cache rows (dim ``axis``) of the hypotheses each new beam slot continues."""
    batch, beam = beams.shape

    def one(x):
        if x.ndim <= axis or x.shape[axis] != batch * beam:
            return x  # shared across hypotheses (e.g. the cache index)
        # Reshaped to [batch, beam, ...], the gather stays within a batch row, so a
        # batch split over devices stays local.
        rows = jnp.moveaxis(x, axis, 0)
        rows = rows.reshape(batch, beam, *rows.shape[1:])
        rows = _gather_beams(rows, beams).reshape(batch * beam, *rows.shape[2:])
        return jnp.moveaxis(rows, 0, axis)

    return jax.tree.map(one, cache)


def beam_search(
    step_fn: Callable[[Any, jax.Array, jax.Array], tuple[jax.Array, Any]],
    cache: Any,
    *,
    batch_size: int,
    beam_size: int,
    max_len: int,
    eos_id: int,
    alpha: float,
    pad_id: int = 0,
    bos_id: int = 0,
    cache_axis: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """Finds the ``beam_size`` best outputs of every batch row; jit-friendly.

    Args:
      step_fn: ``(cache, tokens, index) -> (logits, cache)``: tokens int32
        [batch * beam, 1] (the previous token of each hypothesis, ``bos_id``
        first), index the int32 scalar position being decoded; logits float
        [batch * beam, vocab].
      cache: the initial cache; leaves with leading dim ``batch * beam`` follow
        their hypotheses, other leaves are shared.
      batch_size: rows of the batch.
      beam_size: hypotheses kept per row.
      max_len: tokens per output (static).
      eos_id: end-of-sequence id: ends a hypothesis (and is kept in it).
      alpha: length-penalty exponent, >= 0.
      pad_id: never emitted; fills outputs after EOS.
      bos_id: the first token fed to ``step_fn``.
      cache_axis: the dim of the cache leaves that holds the ``batch * beam`` rows.

    Returns:
      (int32 [batch, beam, max_len] outputs, float32 [batch, beam] scores), best
      first. Rows where nothing finished within ``max_len`` return their live
      hypotheses scored with ``lp(max_len)``.
    """
    if alpha < 0:
        raise ValueError(f"length penalty alpha must be >= 0, got {alpha}")
    batch, beam = batch_size, beam_size
    max_penalty = length_penalty(max_len, alpha)

    def step(state: _State) -> _State:
        i = state.index
        previous = jnp.where(
            i == 0,
            bos_id,
            jax.lax.dynamic_index_in_dim(state.alive_seqs, jnp.maximum(i - 1, 0), 2, False),
        )  # [batch, beam]
        logits, cache = step_fn(state.cache, previous.reshape(batch * beam, 1), i)
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        vocab = logp.shape[-1]
        logp = logp.at[:, pad_id].set(NEG_INF).reshape(batch, beam, vocab)
        # [batch, beam * vocab] -> the 2 * beam best extensions of each row.
        candidates = (state.alive_logp[..., None] + logp).reshape(batch, beam * vocab)
        top_logp, top_index = jax.lax.top_k(candidates, 2 * beam)
        origin, token = top_index // vocab, (top_index % vocab).astype(jnp.int32)
        seqs = _gather_beams(state.alive_seqs, origin)  # [batch, 2 * beam, max_len]
        seqs = jax.lax.dynamic_update_slice_in_dim(seqs, token[..., None], i, axis=2)
        # Extensions of the empty slots of step 0 (or of the padding id) are not real
        # hypotheses; they may fill the live beam of a tiny vocabulary, never the finished.
        ended = (token == eos_id) & (top_logp > NEG_INF / 2)

        # Live: the best extensions that did not end.
        alive_logp, keep = jax.lax.top_k(jnp.where(ended, NEG_INF, top_logp), beam)
        alive_seqs = _gather_beams(seqs, keep)
        cache = _reorder_cache(cache, _gather_beams(origin, keep), cache_axis)

        # Finished: merge the ones that ended now into the best so far.
        scores = jnp.where(ended, top_logp / length_penalty(i + 1, alpha), NEG_INF)
        all_scores = jnp.concatenate([state.done_scores, scores], axis=1)
        all_flags = jnp.concatenate([state.done_flags, ended], axis=1)
        all_seqs = jnp.concatenate([state.done_seqs, seqs], axis=1)
        done_scores, best = jax.lax.top_k(all_scores, beam)
        return _State(
            index=i + 1,
            cache=cache,
            alive_seqs=alive_seqs,
            alive_logp=alive_logp,
            done_seqs=_gather_beams(all_seqs, best),
            done_scores=done_scores,
            done_flags=_gather_beams(all_flags, best),
        )

    def not_done(state: _State) -> jax.Array:
        worst_done = jnp.where(state.done_flags.all(axis=1), state.done_scores[:, -1], NEG_INF)
        best_reachable = state.alive_logp[:, 0] / max_penalty
        return (state.index < max_len) & ~jnp.all(worst_done >= best_reachable)

    seqs = jnp.full((batch, beam, max_len), pad_id, jnp.int32)
    # All hypotheses start equal: only the first one is expanded at step 0.
    alive_logp = jnp.tile(jnp.array([0.0] + [NEG_INF] * (beam - 1), jnp.float32), (batch, 1))
    state = _State(
        index=jnp.zeros((), jnp.int32),
        cache=cache,
        alive_seqs=seqs,
        alive_logp=alive_logp,
        done_seqs=seqs,
        done_scores=jnp.full((batch, beam), NEG_INF, jnp.float32),
        done_flags=jnp.zeros((batch, beam), bool),
    )
    state = jax.lax.while_loop(not_done, step, state)
    none_done = ~state.done_flags.any(axis=1)
    out_seqs = jnp.where(none_done[:, None, None], state.alive_seqs, state.done_seqs)
    out_scores = jnp.where(none_done[:, None], state.alive_logp / max_penalty, state.done_scores)
    return out_seqs, out_scores
