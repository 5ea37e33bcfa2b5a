"""The shared cross entropy: its values and gradient against float64 NumPy, and its
memory as XLA's buffer assignment holds it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import losses


def _reference(logits, targets, weights, label_smoothing):
    """The smoothed loss as its definition says, in float64: sum over tokens of
    KL(q || softmax(logits)) and its gradient."""
    logits = logits.astype(np.float64)
    vocab = logits.shape[-1]
    q = np.full(logits.shape, label_smoothing / (vocab - 1))
    np.put_along_axis(q, targets[..., None], 1.0 - label_smoothing, axis=-1)
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    with np.errstate(divide="ignore", invalid="ignore"):
        q_log_q = np.where(q > 0, q * np.log(q), 0.0)
    loss = ((q_log_q - q * log_p).sum(-1) * weights).sum()
    grad = (np.exp(log_p) - q) * weights[..., None]  # d KL / d logits, per token
    return loss, grad


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_loss_and_its_gradient_are_the_definitions(label_smoothing):
    rng = np.random.default_rng(0)
    logits = (3 * rng.standard_normal((2, 5, 11))).astype(np.float32)
    targets = rng.integers(0, 11, (2, 5))
    weights = (rng.random((2, 5)) > 0.3).astype(np.float32)

    def loss(x):
        return losses.cross_entropy_and_metrics(x, targets, weights, label_smoothing)

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(logits))
    want, want_grad = _reference(logits, targets, weights, label_smoothing)
    np.testing.assert_allclose(value, want, rtol=1e-6)
    np.testing.assert_allclose(grad, want_grad, atol=1e-6)
    nll, nll_grad = _reference(logits, targets, weights, 0.0)
    np.testing.assert_allclose(metrics["nll"], nll, rtol=1e-6)
    # The nll shares the loss's logsumexp; its own gradient is the unsmoothed one.
    got = jax.grad(lambda x: loss(x)[1]["nll"])(jnp.asarray(logits))
    np.testing.assert_allclose(got, nll_grad, atol=1e-6)
    # bf16 logits get a bf16 gradient: the float32 one is never formed (below).
    bf16 = jax.grad(lambda x: loss(x)[0])(jnp.asarray(logits, jnp.bfloat16))
    assert bf16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(bf16, np.float32), want_grad, atol=2e-2)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_accuracy_is_numpys_argmax_with_its_ties(dtype):
    # Logits on a coarse grid tie often: argmax takes the first of equal maxima, so a
    # label tied with an earlier id is wrong and a label tied with a later one right.
    rng = np.random.default_rng(0)
    logits = np.round(rng.standard_normal((4, 64, 9))).astype(np.float32)
    logits[0, :, 3:] = logits[0, :, :1]  # ids 0 and 3-8 tie: only 0 (or 1, 2) can win
    top = logits.argmax(-1)
    tied_later = (logits == logits.max(-1, keepdims=True)) & (np.arange(9) > top[..., None])
    targets = np.where(rng.random((4, 64)) < 0.5, top, tied_later.argmax(-1))
    targets = np.where(rng.random((4, 64)) < 0.2, rng.integers(0, 9, (4, 64)), targets)
    weights = (rng.random((4, 64)) > 0.1).astype(np.float32)
    want = top == targets
    holds_the_max = np.take_along_axis(logits, targets[..., None], -1)[..., 0] == logits.max(-1)
    assert 0.2 < want.mean() < 0.8 and (holds_the_max & ~want).any()  # an earlier id wins
    got = losses.is_argmax(jnp.asarray(logits, dtype), jnp.asarray(targets))
    np.testing.assert_array_equal(got, want)
    _, metrics = losses.cross_entropy_and_metrics(jnp.asarray(logits, dtype), targets, weights)
    assert metrics["accuracy"] == (want * weights).sum()


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_the_loss_and_its_gradient_hold_no_float32_logits(label_smoothing):
    # bf16 logits [rows, length, vocab] are a step's largest activation. The loss reads
    # them through reductions and one elementwise gradient only, so no float32 copy of
    # them (log-probabilities, softmax, gradient) is written out: XLA:CPU's temporaries
    # for the loss and its gradient are the size of the logits in float32 (two bf16
    # arrays), where log_softmax and autodiff made them 4.0x.
    rows, length, vocab = 4, 256, 32000
    logits = jax.ShapeDtypeStruct((rows, length, vocab), jnp.bfloat16)
    targets = jax.ShapeDtypeStruct((rows, length), jnp.int32)

    def loss(x, t):
        return losses.cross_entropy_and_metrics(x, t, label_smoothing=label_smoothing)[0]

    compiled = jax.jit(jax.value_and_grad(loss)).lower(logits, targets).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp / (rows * length * vocab * 4) < 1.01
