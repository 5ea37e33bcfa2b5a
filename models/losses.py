"""Losses shared by the models: label-smoothed cross entropy with metric sums."""

import functools
import math

import jax
import jax.numpy as jnp

Array = jax.Array


def cross_entropy_and_metrics(
    logits: Array, targets: Array, weights: Array | None = None, label_smoothing: float = 0.0
) -> tuple[Array, dict[str, Array]]:
    """Label-smoothed cross entropy, summed (not averaged) over tokens.

    The smoothed target puts 1 - label_smoothing on the label and label_smoothing / (V - 1)
    on every other token. Its entropy is subtracted, making the loss a KL divergence: a
    prediction equal to the smoothed target scores 0.

    Args:
      logits: float [batch, length, vocab].
      targets: int [batch, length].
      weights: float [batch, length]; defaults to (targets > 0).
      label_smoothing: Python float in [0, 1).

    Returns:
      (loss_sum, metrics); metrics holds sums "loss", "nll" (unsmoothed), "accuracy" (correct
      tokens) and "weight" (real tokens).
    """
    vocab = logits.shape[-1]
    if weights is None:
        weights = (targets > 0).astype(jnp.float32)
    confidence, low = 1.0 - label_smoothing, label_smoothing / (vocab - 1)
    # Entropy of the smoothed target, with 0 * log 0 = 0.
    entropy = -sum(p * math.log(p) * n for p, n in ((confidence, 1), (low, vocab - 1)) if p > 0)
    cross_entropy, label_log_prob = _cross_entropy(logits, targets, confidence, low)
    loss = ((cross_entropy - entropy) * weights).sum()
    metrics = {
        "loss": loss,
        "nll": (-label_log_prob * weights).sum(),
        "accuracy": (is_argmax(logits, targets) * weights).sum(),
        "weight": weights.sum(),
    }
    return loss, metrics


def is_argmax(logits: Array, targets: Array) -> Array:
    """``logits.argmax(-1) == targets``, bool [...]: the label holds the largest logit
    and no earlier id ties it (argmax takes the first of equal maxima).

    Without argmax's reduce: it keeps a value and an index per step, a two-output
    reduce that XLA:CPU runs as a scalar loop. One max and one comparison pass instead
    took the loss, its gradient and the accuracy from 4.6 to 1.9 ms on one core for the
    2M decoder's bf16 logits a device ([2, 128, 4096]; 17 to 7 ms for the 64M's
    [1, 128, 32000]). The logsumexp's float32 max is not shared: comparing in float32
    to share it was slower (2.1 ms).
    A NaN logit counts as wrong here, where argmax could point at it.
    """
    top = logits.max(-1)
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    earlier_tie = ((logits == top[..., None]) & (ids < targets[..., None])).any(-1)
    return (_label_logit(logits, targets) == top) & ~earlier_tie


def _label_logit(logits: Array, targets: Array) -> Array:
    return jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cross_entropy(
    logits: Array, targets: Array, confidence: float, low: float
) -> tuple[Array, Array]:
    """Per token, ``-sum_v q_v log p_v`` for ``q = low + (confidence - low) * onehot``
    and ``p = softmax(logits)``, and the label's ``log p``, in float32 whatever the
    logits' dtype (one logsumexp for both).

    ``log p_v = logits_v - logsumexp(logits)`` is never formed as a ``[..., vocab]``
    array, and the gradient comes back in the logits' dtype from one elementwise
    expression: only reductions and that expression read the logits, so the compiler
    fuses their cast to float32 into them instead of writing float32 logits, or a
    float32 gradient, out. Each is a ``[rows, length, vocab]`` float32 array, 1.46 GiB
    a chip at MaxText's 16B on v5e-256 (6 rows of 2,048 over 32,000 ids), where its
    bf16 logits take 0.73: log_softmax's took 1.11 GiB off that program's heap
    (docs/aot.md), and on XLA:CPU the custom gradient halves the loss's temporaries
    again (tests/models/test_losses.py).
    """
    return _cross_entropy_forward(logits, targets, confidence, low)[0]


def _cross_entropy_forward(logits, targets, confidence, low):
    logits32 = logits.astype(jnp.float32)
    log_norm = jax.nn.logsumexp(logits32, axis=-1)
    label_log_prob = _label_logit(logits32, targets) - log_norm
    token_losses = -(confidence - low) * label_log_prob
    if low > 0:  # sum_v log p_v = sum_v logits_v - vocab * logsumexp
        token_losses -= low * (logits32.sum(-1) - logits.shape[-1] * log_norm)
    return (token_losses, label_log_prob), (logits, targets, log_norm)


def _cross_entropy_backward(confidence, low, residuals, grads):
    # d token_loss / d logits_v = (confidence - low + low * vocab) p_v
    #                             - (confidence - low) [v = t] - low,
    # d label_log_prob / d logits_v = [v = t] - p_v.
    logits, targets, log_norm = residuals
    g_loss, g_label = (g[..., None] for g in grads)
    probs = jnp.exp(logits.astype(jnp.float32) - log_norm[..., None])
    label = jnp.arange(logits.shape[-1]) == targets[..., None]
    scale = confidence - low + low * logits.shape[-1]
    # The loss's term as one factor times its cotangent, as when it was the only output
    # (the nll's cotangent is zero in training: adding its term changes no bit).
    d_logits = (scale * probs - jnp.where(label, confidence - low, 0.0) - low) * g_loss
    d_logits += (label - probs) * g_label
    return d_logits.astype(logits.dtype), None


_cross_entropy.defvjp(_cross_entropy_forward, _cross_entropy_backward)
