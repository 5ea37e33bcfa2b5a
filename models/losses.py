"""Losses shared by the models: label-smoothed cross entropy with metric sums."""

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
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    label_log_prob = jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]
    # -sum_v q_v log p_v with q = low + (confidence - low) * onehot, without a
    # [batch, length, vocab] one-hot.
    cross_entropy = -((confidence - low) * label_log_prob + low * log_probs.sum(-1))
    loss = ((cross_entropy - entropy) * weights).sum()
    metrics = {
        "loss": loss,
        "nll": (-label_log_prob * weights).sum(),
        "accuracy": ((logits.argmax(-1) == targets) * weights).sum(),
        "weight": weights.sum(),
    }
    return loss, metrics
