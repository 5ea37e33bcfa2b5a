"""The inner optax optimizer and its learning-rate schedule, from the config.

The optimizer built here sees the master weights in the update-sharding plan's
stored layout (see :mod:`trainer.parallel.plan`). What it decays and how it takes a
per-tensor norm are decided by what each parameter is, in any layout
(:mod:`trainer.training.layerwise`): masks are trees of booleans, and trust ratios are
one per layer of a stack.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_collections
import optax

from trainer.errors import ConfigError
from trainer.training import layerwise

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


def make_optimizer(
    config: ml_collections.ConfigDict, param_views, num_train_steps: int
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds the inner optimizer named by ``config.name``.

    Weight decay and LAMB/LARS trust ratios apply to the weights, not to norm scales
    or biases, and a trust ratio is one per layer of a stack
    (:mod:`trainer.training.layerwise`).

    Args:
      config: the ``optimizer`` section of the run config.
      param_views: a tree of :class:`~trainer.training.layerwise.ParamView`: each
        parameter's role and layers, in the form the optimizer is handed it
        (``layerwise.views(plan.layouts, plan.stacks)``).
      num_train_steps: for decaying schedules.

    Returns:
      ``(optimizer, schedule)``.
    """
    lr = make_schedule(config, num_train_steps)
    name = config.name
    if name == "sgd":
        tx = optax.sgd(lr)
    elif name == "momentum":
        tx = optax.sgd(lr, momentum=config.momentum, nesterov=config.nesterov)
    elif name == "adam":
        tx = optax.adam(lr, b1=config.b1, b2=config.b2, eps=config.eps)
    elif name == "adamw":
        tx = optax.adamw(
            lr,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=layerwise.decay_mask(param_views),
        )
    elif name == "lamb":
        tx = layerwise.lamb(
            lr,
            param_views,
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
        )
    elif name == "lars":
        tx = layerwise.lars(
            lr,
            param_views,
            weight_decay=config.weight_decay,
            trust_coefficient=config.trust_coefficient,
            momentum=config.momentum,
            nesterov=config.nesterov,
        )
    else:
        raise ConfigError(f"optimizer.name must be one of {OPTIMIZERS}, got '{name}'")
    if config.clip_norm > 0:
        tx = optax.chain(optax.clip_by_global_norm(config.clip_norm), tx)
    return tx, lr
