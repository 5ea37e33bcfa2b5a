"""The inner optax optimizer and its learning-rate schedule, from the config.

The optimizer built here sees the master weights in the update-sharding plan's
stored layout (see :mod:`trainer.parallel.plan`). Masks are therefore computed
here, once, on the *logical* parameters and passed as trees of booleans, which
keep their meaning in any layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from trainer.errors import ConfigError

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "rsqrt", "cosine", "polynomial")


def make_schedule(config: ml_collections.ConfigDict, num_train_steps: int) -> optax.Schedule:
    """Learning-rate schedule with linear warm-up.

    ``rsqrt`` is the Transformer schedule: linear warm-up to ``learning_rate``
    over ``warmup_steps``, then ``learning_rate * sqrt(warmup_steps / step)``.
    """
    peak, warmup = config.learning_rate, config.warmup_steps
    name = config.schedule
    if name == "constant":
        decay = optax.constant_schedule(peak)
    elif name == "rsqrt":

        def decay(count):
            return peak * jnp.sqrt(max(warmup, 1) / jnp.maximum(count + warmup, 1))

    elif name == "cosine":
        # To end_learning_rate (Llama's runs end at a tenth of the peak), not to 0.
        alpha = config.end_learning_rate / peak if peak else 0.0
        decay = optax.cosine_decay_schedule(peak, max(num_train_steps - warmup, 1), alpha)
    elif name == "polynomial":
        decay = optax.polynomial_schedule(
            peak, config.end_learning_rate, config.power, max(num_train_steps - warmup, 1)
        )
    else:
        raise ConfigError(f"optimizer.schedule must be one of {SCHEDULES}, got '{name}'")
    if warmup <= 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def decay_mask(abstract_params):
    """True for weights that get weight decay / trust ratios: matrices and
    embeddings, not biases or norm scales (rank <= 1), judged on logical shapes."""
    return jax.tree.map(lambda p: len(p.shape) > 1, abstract_params)


def make_optimizer(
    config: ml_collections.ConfigDict, abstract_params, num_train_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the inner optimizer named by ``config.name``.

    Args:
      config: the ``optimizer`` section of the run config.
      abstract_params: logical params (shapes only) for the masks.
      num_train_steps: for decaying schedules.

    Returns:
      ``(optimizer, schedule)``.
    """
    lr = make_schedule(config, num_train_steps)
    mask = decay_mask(abstract_params)
    name = config.name
    if name == "sgd":
        tx = optax.sgd(lr)
    elif name == "momentum":
        tx = optax.sgd(lr, momentum=config.momentum, nesterov=config.nesterov)
    elif name == "adam":
        tx = optax.adam(lr, b1=config.b1, b2=config.b2, eps=config.eps)
    elif name in ("adamw", "lamb"):
        # The same arguments: LAMB is AdamW with a per-layer trust ratio.
        tx = getattr(optax, name)(
            lr,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=mask,
        )
    elif name == "lars":
        tx = optax.lars(
            lr,
            weight_decay=config.weight_decay,
            weight_decay_mask=mask,
            trust_coefficient=config.trust_coefficient,
            trust_ratio_mask=mask,
            momentum=config.momentum,
            nesterov=config.nesterov,
        )
    else:
        raise ConfigError(f"optimizer.name must be one of {OPTIMIZERS}, got '{name}'")
    if config.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(config.clip_norm), tx)
    return tx, lr
