"""Beam search (models/beam_search.py, models/decode.py) against references it does not use:
a hand-computed length-penalty case, exhaustive search on a tiny Transformer, greedy
decoding, and each row decoded alone."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_TRANSFORMER

from models import decode as decode_lib
from models.beam_search import beam_search, length_penalty
from models.transformer import Transformer, TransformerConfig

PAD, EOS, A, B, C, D = range(6)


def test_length_penalty_values():
    assert float(length_penalty(1, 0.6)) == pytest.approx(1.0)
    assert float(length_penalty(7, 1.0)) == pytest.approx(2.0)
    assert float(length_penalty(10, 0.6)) == pytest.approx(2.5**0.6)
    assert float(length_penalty(10, 0.0)) == 1.0


def _table_step_fn():
    """A "model" whose next-token distribution depends on the previous token only.

    After BOS: EOS 0.40, A 0.39, B/C/D 0.07 each. After A: EOS 0.95, each other
    0.0125. After B/C/D/EOS: uniform over the five real ids.
    """
    table = np.full((6, 6), 0.2)
    table[PAD] = [0, 0.40, 0.39, 0.07, 0.07, 0.07]
    table[A] = [0, 0.95, 0.0125, 0.0125, 0.0125, 0.0125]
    table[:, PAD] = 1e-30  # the padding id: masked by the search anyway
    logits = jnp.log(jnp.asarray(table, jnp.float32))

    def step_fn(cache, tokens, index):
        del index
        return logits[tokens[:, 0]], cache

    return step_fn


@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_length_penalty_decides_between_short_and_long(alpha):
    # [EOS]: log 0.40 = -0.916 over lp(1) = 1. [A, EOS]: log 0.39 + log 0.95 = -0.993 over
    # lp(2) = (7/6)^alpha: -0.993 at alpha 0 (loses), -0.905 at alpha 0.6 (wins).
    seqs, scores = jax.jit(
        lambda: beam_search(
            _table_step_fn(),
            jnp.zeros(()),
            batch_size=1,
            beam_size=2,
            max_len=4,
            eos_id=EOS,
            alpha=alpha,
        )
    )()
    short, long = math.log(0.40), (math.log(0.39) + math.log(0.95)) / (7 / 6) ** alpha
    ranked = sorted([(short, [EOS, 0, 0, 0]), (long, [A, EOS, 0, 0])], reverse=True)
    np.testing.assert_array_equal(seqs[0], [s for _, s in ranked])
    np.testing.assert_allclose(scores[0], [v for v, _ in ranked], rtol=1e-6)


def _tiny_transformer(vocab: int):
    cfg = TransformerConfig(
        **{
            **TINY_TRANSFORMER,
            "vocab_size": vocab,
            "num_decoder_layers": 2,
            "max_len": 16,
            "dtype": jnp.float32,
        }
    )
    model = Transformer(cfg)
    ones = jnp.ones((1, 4), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), ones, ones)["params"]
    # Sharper than at initialisation, so hypotheses are well apart.
    params = jax.tree.map(lambda p: p * 3.0, params)
    return model, params


def _teacher_forced_logp(model, params, inputs, outputs):
    """Log-probability of each output row given its source, by the full forward pass."""
    logits = model.apply({"params": params}, inputs, outputs)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, outputs[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(outputs > 0, picked, 0.0), axis=-1)


def test_exhaustive_search_equals_brute_force():
    # Vocabulary {PAD, EOS, 5 words}, outputs of at most 3 tokens: 31 finished outputs
    # ([EOS], [w, EOS], [w, w, EOS]). A beam of 75 keeps every candidate at every step
    # (2 * 75 >= 25 prefixes x 6 ids), so the search is exhaustive: its finished list
    # must be all 31, ranked by the penalised scores of the teacher-forced model.
    vocab, max_len, alpha = 7, 3, 0.6
    model, params = _tiny_transformer(vocab)
    inputs = jnp.array([[2, 3, 4, 5, 1], [6, 2, 1, 0, 0]], jnp.int32)
    words = range(2, vocab)
    finished = [[EOS]] + [[w, EOS] for w in words]
    finished += [[w, v, EOS] for w, v in itertools.product(words, words)]
    outputs = jnp.array([f + [0] * (max_len - len(f)) for f in finished], jnp.int32)
    lengths = jnp.array([len(f) for f in finished])
    seqs, scores = jax.jit(
        lambda p, x: decode_lib.beam_decode(
            model, p, x, beam_size=75, max_decode_len=max_len, alpha=alpha, eos_id=EOS
        )
    )(params, inputs)
    # (Compiled, it fuses differently from the search: scores agree to ~4e-6 relative.)
    logp_of = jax.jit(lambda p, x, y: _teacher_forced_logp(model, p, x, y))
    for row in range(2):
        source = jnp.broadcast_to(inputs[row], (len(finished), inputs.shape[1]))
        logp = logp_of(params, source, outputs)
        want = np.asarray(logp / length_penalty(lengths, alpha))
        order = np.argsort(-want)
        np.testing.assert_allclose(scores[row, :31], want[order], rtol=1e-5, atol=1e-4)
        assert np.all(scores[row, 31:] < -1e6)  # empty slots
        # Equal sequences where the scores are apart (ties could swap places).
        gaps = np.diff(want[order])
        clear = np.concatenate([[True], gaps < -1e-3]) & np.concatenate([gaps < -1e-3, [True]])
        np.testing.assert_array_equal(np.asarray(seqs[row, :31])[clear], outputs[order][clear])


# An id the random model emits in some rows and not others (it rarely picks id 1), so
# rows stop at different steps.
STOP = 50


def _padded_batch():
    rows = [[5, 9, 12, 7, 30, 1], [44, 3, 1], [], [17, 21, 1]]  # [] = a padding row
    return jnp.array([r + [0] * (8 - len(r)) for r in rows], jnp.int32)


@pytest.mark.slow  # 10 s of compiles; the brute-force test covers the search in the default suite
def test_beam_of_one_without_penalty_is_greedy():
    model, params = _tiny_transformer(64)
    inputs = _padded_batch()
    greedy = jax.jit(
        lambda p, x: decode_lib.greedy_decode(model, p, x, max_decode_len=10, eos_id=STOP)
    )(params, inputs)
    beam = jax.jit(
        lambda p, x: decode_lib.beam_decode(
            model, p, x, beam_size=1, max_decode_len=10, alpha=0.0, eos_id=STOP
        )[0][:, 0]
    )(params, inputs)
    assert (greedy == STOP).any() and not (greedy == STOP).any(1).all()
    np.testing.assert_array_equal(beam, greedy)


@pytest.mark.slow  # ~8 s of compiles, cold
def test_padded_rows_decode_as_when_alone():
    # Rows of different lengths (and a padding row) in one batch: each row's beam output
    # equals that row decoded on its own, without padding.
    model, params = _tiny_transformer(64)
    inputs = _padded_batch()
    run = jax.jit(
        lambda p, x: decode_lib.decode(
            model, p, x, beam_size=4, max_decode_len=10, alpha=0.6, eos_id=STOP
        )
    )
    together = np.asarray(run(params, inputs))
    assert np.all(np.isfinite(together))
    for row in (0, 1, 3):
        alone = inputs[row : row + 1, : int((inputs[row] > 0).sum())]
        np.testing.assert_array_equal(np.asarray(run(params, alone))[0], together[row])
