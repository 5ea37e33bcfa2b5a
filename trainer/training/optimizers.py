"""The inner optax optimizer and its learning-rate schedule, from the config.

The optimizer built here sees the master weights in the update-sharding plan's
stored layout (see :mod:`trainer.parallel.plan`). What it decays and how it takes a
per-tensor norm are decided by what each parameter is, in any layout
(:mod:`trainer.training.layerwise`): masks are trees of booleans, and trust ratios are
one per layer of a stack.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
import optax

from trainer.errors import ConfigError
from trainer.training import layerwise

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "lamb", "lars")
SCHEDULES = ("constant", "rsqrt", "cosine", "polynomial")


def warmup_steps(config: ml_collections.ConfigDict, num_train_steps: int) -> int:
    """The warm-up's steps: ``warmup_steps`` where set (> 0), else ``warmup_ratio`` of
    the run's steps, so that a preset's ratio yields to a user's step count."""
    if config.warmup_steps > 0:
        return config.warmup_steps
    return round(config.warmup_ratio * num_train_steps)


def make_schedule(config: ml_collections.ConfigDict, num_train_steps: int) -> optax.Schedule:
    """Learning-rate schedule with linear warm-up (``warmup_steps``, or where that is 0
    ``warmup_ratio`` of ``num_train_steps``, as Hugging Face's Trainer takes the two).

    ``rsqrt`` is the Transformer schedule: linear warm-up to ``learning_rate``
    over ``warmup_steps``, then ``learning_rate * sqrt(warmup_steps / step)``.
    """
    peak, warmup = config.learning_rate, warmup_steps(config, num_train_steps)
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


def describe(config: ml_collections.ConfigDict, param_views, num_train_steps: int) -> str:
    """The optimizer in one line, as the run says it at start: its name and settings,
    the schedule, and what weight decay applies to."""
    name = config.name
    parts = [f"optimizer {name}: learning rate {config.learning_rate:.3g}"]
    schedule = config.schedule
    warmup = warmup_steps(config, num_train_steps)
    if warmup > 0:
        schedule += f" after {warmup:,} warm-up steps"
    if config.schedule in ("cosine", "polynomial"):
        schedule += f" to {config.end_learning_rate:.3g} at step {num_train_steps:,}"
    parts.append(schedule)
    if name in ("adam", "adamw", "lamb"):
        parts.append(f"b1 {config.b1} b2 {config.b2} eps {config.eps:g}")
    if name in ("momentum", "lars"):
        parts.append(f"momentum {config.momentum}" + (" (Nesterov)" if config.nesterov else ""))
    if name in ("adamw", "lamb", "lars") and config.weight_decay:
        # Tensors counted per layer: the same line whether the layers are stacked or not.
        counts = [(v.layout.shape[0] if v.stacked else 1, v.decayed) for v in _leaves(param_views)]
        decayed = sum(n for n, d in counts if d)
        what = "and trust ratios (per layer) " if name in ("lamb", "lars") else ""
        parts.append(
            f"weight decay {config.weight_decay:g} {what}on {decayed} weights, not on "
            f"{sum(n for n, _ in counts) - decayed} norm scales and biases"
        )
    elif name in ("lamb", "lars"):
        parts.append("trust ratios per layer, not on norm scales and biases")
    if config.clip_norm > 0:
        parts.append(f"gradients clipped to norm {config.clip_norm:g}")
    return "; ".join(parts)


def _leaves(param_views) -> list:
    return list(jax.tree.leaves(param_views, is_leaf=lambda x: isinstance(x, layerwise.ParamView)))


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
