"""What the optimizer knows of each parameter: its role and its layers, in any layout.

The optimizer runs on the master weights as the update-sharding plan stores them
(:mod:`trainer.parallel.layout`): merged, padded, sharded, and with a scanned stack of
layers as one ``[layers, ...]`` tensor. None of that may change the math, so two
things are decided here from what a parameter *is*, never from its stored shape:

**Its role, by its name** (the last part: flax's names and the models' own):

====================  ==========  ===============================================
last part of name     role        weight decay, LAMB/LARS trust ratio
====================  ==========  ===============================================
``scale``             ``norm``    no (LayerNorm, RMSNorm and BatchNorm scales)
``bias``, ``*_bias``  ``bias``    no (of any shape: q/k/v biases are ``[heads, d]``)
anything else         ``weight``  yes (kernels, projections, embedding tables)
====================  ==========  ===============================================

This is the rule of BERT's LAMB (TensorFlow's ``exclude_from_weight_decay`` of
``LayerNorm`` and ``bias``, which ``exclude_from_layer_adaptation`` follows), of
Hugging Face's ``Trainer`` (no decay for biases and norm weights) and of the
PyTorch parity test (tests/training/test_torch_parity.py). A rank rule ("rank <= 1")
decays a stacked ``[layers, emb]`` norm scale and a ``[heads, head_dim]`` bias.

**Its layers**: a stack's leading layers dim is invisible to per-tensor rules. A
trust ratio ``||w|| / ||u||`` is one per layer of a stack, as it would be on the
unstacked model, computed on the stored layout by
:meth:`~trainer.parallel.layout.LeafLayout.layer_sums`: each shard's partial sums of
squares of each layer, summed over the shards (one all-reduce of a ``[layers]``
vector per tensor; Xu et al. 2020, section 3.2, for LAMB), never a gather of the
tensor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from trainer.parallel.layout import LeafLayout
from trainer.parallel.rules import param_name

ROLES = ("weight", "norm", "bias")


def role(name: str) -> str:
    """The role of parameter ``name`` (``"a/b/kernel"``): see the module doc."""
    leaf = name.rsplit("/", 1)[-1]
    if leaf == "scale":
        return "norm"
    if leaf == "bias" or leaf.endswith("_bias"):
        return "bias"
    return "weight"


@dataclasses.dataclass(frozen=True)
class ParamView:
    """How the optimizer sees one parameter.

    Attributes:
      name: the parameter's name (``"layers/mlp/up"``).
      layout: the form the optimizer is handed it in (its stored layout; an
        unsharded layout of the logical shape for the logical form).
      stacked: whether logical dim 0 is a stack's layers.
    """

    name: str
    layout: LeafLayout
    stacked: bool = False

    @property
    def role(self) -> str:
        return role(self.name)

    @property
    def decayed(self) -> bool:
        """Weight decay and trust ratios apply (a weight, not a norm scale or bias)."""
        return self.role == "weight"

    def sum_of_squares(self, x: jax.Array) -> jax.Array:
        """Sum of squares of ``x`` (in this view's form): one per layer ``[layers]``
        for a stack, a scalar otherwise; padding is zero and adds nothing."""
        squares = jnp.square(x.astype(jnp.promote_types(x.dtype, jnp.float32)))
        if self.stacked:
            return self.layout.layer_sums(squares)
        return jnp.sum(squares)

    def scale(self, x: jax.Array, factor: jax.Array) -> jax.Array:
        """``x`` times ``factor`` (one per layer for a stack, else a scalar)."""
        factor = factor.astype(x.dtype)
        if self.stacked:
            return x * self.layout.layer_broadcast(factor, x)
        return x * factor


def _is_view(x) -> bool:
    return isinstance(x, ParamView)


def views(layouts, stacks=None) -> Any:
    """A tree of :class:`ParamView` for parameters in the form ``layouts`` describe
    (a plan's stored layouts, or :func:`logical_layouts`).

    Args:
      layouts: a tree of :class:`~trainer.parallel.layout.LeafLayout`.
      stacks: a tree like it of each parameter's stack of layers (its name, or "";
        default: no stacks).
    """
    is_layout = lambda x: isinstance(x, LeafLayout)  # noqa: E731
    if stacks is None:
        stacks = jax.tree.map(lambda _: "", layouts, is_leaf=is_layout)
    return jax.tree_util.tree_map_with_path(
        lambda path, lay, stack: ParamView(param_name(path), lay, bool(stack)),
        layouts,
        stacks,
        is_leaf=is_layout,
    )


def logical_layouts(abstract_params) -> Any:
    """Unsharded layouts of the parameters' logical shapes (the optimizer on the
    logical form: ``update_sharding=none`` or a reference)."""
    return jax.tree.map(lambda p: LeafLayout(tuple(p.shape), ((),) * len(p.shape)), abstract_params)


def decay_mask(param_views) -> Any:
    """A tree of bools: weight decay (and trust ratios) for :attr:`ParamView.decayed`."""
    return jax.tree.map(lambda v: v.decayed, param_views, is_leaf=_is_view)


class _Empty(NamedTuple):
    """No state."""


def scale_by_trust_ratio(
    param_views,
    *,
    min_norm: float = 0.0,
    trust_coefficient: float = 1.0,
    eps: float = 0.0,
) -> optax.GradientTransformation:
    """optax's ``scale_by_trust_ratio``, one ratio per layer of a stack and only for
    the decayed parameters (weights; norm scales and biases pass unscaled).

    ``u <- u * trust_coefficient * ||w|| / (||u|| + eps)``, norms at least
    ``min_norm``, and 1 where either norm is zero, per parameter and per layer.

    Args:
      param_views: a tree of :class:`ParamView` like the params, in the form the
        transform is handed them.
    """

    def update_fn(updates, state, params=None):
        if params is None:
            raise ValueError("a trust ratio needs the params: update(updates, state, params)")

        def scaled(view, u, w):
            if not view.decayed:
                return u
            w_norm = jnp.maximum(jnp.sqrt(view.sum_of_squares(w)), min_norm)
            u_norm = jnp.maximum(jnp.sqrt(view.sum_of_squares(u)), min_norm)
            ratio = trust_coefficient * w_norm / (u_norm + eps)
            ratio = jnp.where((w_norm == 0) | (u_norm == 0), 1.0, ratio)
            return view.scale(u, ratio)

        return jax.tree.map(scaled, param_views, updates, params, is_leaf=_is_view), state

    return optax.GradientTransformation(lambda _: _Empty(), update_fn)


def lamb(
    learning_rate,
    param_views,
    *,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
) -> optax.GradientTransformation:
    """LAMB (You et al. 2019) as BERT's reference runs it: Adam's direction, decoupled
    weight decay and a trust ratio per layer for the weights, neither for norm scales
    and biases (optax's ``lamb`` with its trust ratio masked like its decay)."""
    return optax.chain(
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask=decay_mask(param_views)),
        scale_by_trust_ratio(param_views),
        optax.scale_by_learning_rate(learning_rate),
    )


def lars(
    learning_rate,
    param_views,
    *,
    weight_decay: float = 0.0,
    trust_coefficient: float = 0.001,
    eps: float = 0.0,
    momentum: float = 0.9,
    nesterov: bool = False,
) -> optax.GradientTransformation:
    """LARS (You et al. 2017) as optax's ``lars`` with both masks by role, and a trust
    ratio per layer of a stack."""
    return optax.chain(
        optax.add_decayed_weights(weight_decay, mask=decay_mask(param_views)),
        scale_by_trust_ratio(param_views, trust_coefficient=trust_coefficient, eps=eps),
        optax.scale_by_learning_rate(learning_rate),
        optax.trace(decay=momentum, nesterov=nesterov),
    )
