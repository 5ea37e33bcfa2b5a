"""A stack of identical layers, built one way for every family: scanned or one module
a layer, rematerialised by policy, and computing with the weights it is handed.

:func:`layer_stack` is what a model's ``setup`` assigns to its stack's attribute
(``self.layers = layer_stack(DecoderLayer, (cfg,), name="layers", ...)``) and
:func:`run` what its ``__call__`` runs the stack with. Two layouts of the same
parameters (:mod:`models.stacking` converts between them):

* ``scan=True``: one ``nn.scan`` over the layers, each parameter stored
  ``[layers, ...]`` with the logical axis name ``"layers"`` first; the layer's
  ``__call__`` returns ``(x, None)`` (the carry, no per-layer output);
* ``scan=False``: ``layers_0`` ... ``layers_{n-1}``, one module each.

**Weights that are not the parameters as stored.** A model's ``layer_weights`` field
(a tuple of ``(stack name, transform)`` pairs, empty by default) hands a stack's
layers a transform of their parameters, ``transform(params) -> the weights the layer
computes with``, applied to each layer's parameters as it reads them
(``nn.map_variables``). The trainer passes it explicitly for
``optimizer.update_sharding="per_layer"`` (:mod:`trainer.parallel.layer_gather`): each
layer's slice of the shards is all-gathered inside the scan's body when that layer
runs. Such a layer is always rematerialised (keeping at most its matmul outputs), so
that its backward pass gathers the weights again instead of keeping them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

# A layer's params tree -> the weights it computes with (e.g. gathered from shards).
LayerWeights = Callable[[Any], Any]

# Name -> what a layer keeps for its backward pass ("none": no remat at all).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul/conv outputs
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def transform_of(layer_weights: Sequence[tuple[str, LayerWeights]], name: str):
    """The transform ``layer_weights`` (a model's field) gives stack ``name``, or None."""
    return dict(layer_weights).get(name)


def remat_layer(
    layer: type[nn.Module],
    policy: str,
    static_argnums: tuple[int, ...],
    *,
    in_scan: bool = False,
    weights: LayerWeights | None = None,
) -> type[nn.Module]:
    """``layer`` rematerialised under ``policy`` (as is for ``"none"``), computing with
    ``weights(its params)`` if given.

    Args:
      layer: a flax Module class.
      policy: a key of :data:`REMAT_POLICIES`.
      static_argnums: positions of the call's non-array arguments (``self`` is 0),
        e.g. a ``train`` flag, which must be passed positionally.
      in_scan: the layer is the body of a ``scan``. A scan already keeps XLA from
        merging the recomputation back into the forward pass, so the barriers that
        ``prevent_cse`` adds would only cost time there.
      weights: the transform of the layer's parameters (module doc); the layer is
        then rematerialised in any case, ``"none"`` keeping matmul outputs only: a
        policy of names cannot tell the transformed weights or a cast of them apart.
    """
    if policy not in REMAT_POLICIES:
        raise ValueError(f"remat must be one of {sorted(REMAT_POLICIES)}, got '{policy}'")
    keep = REMAT_POLICIES[policy]
    if weights is not None:
        layer = nn.map_variables(
            layer, "params", trans_in_fn=lambda tree: {"params": weights(tree["params"])}
        )
        keep = keep or REMAT_POLICIES["dots"]
    if keep is None:
        return layer
    return nn.remat(layer, policy=keep, static_argnums=static_argnums, prevent_cse=not in_scan)


def layer_stack(
    layer: type[nn.Module],
    args: tuple,
    *,
    name: str,
    length: int,
    scan: bool,
    remat: str,
    static_argnums: tuple[int, ...],
    broadcast: int,
    layer_weights: Sequence[tuple[str, LayerWeights]] = (),
    unroll: int = 1,
    split_rngs: Sequence[str] = ("params",),
):
    """``length`` layers ``layer(*args)`` named ``name``: one ``nn.scan`` (``scan``) or
    a list of modules (assign it to the attribute ``name`` in ``setup``).

    Args:
      layer: the layer's Module class; under ``scan`` its ``__call__`` returns
        ``(x, None)``.
      args: its constructor's arguments (the model config).
      name: the stack's name: its parameters' first path component.
      length: the number of layers.
      scan: one scan over the layers, parameters ``[layers, ...]``.
      remat: a key of :data:`REMAT_POLICIES`.
      static_argnums: the call's non-array arguments (``self`` is 0).
      broadcast: how many arguments after the carry are the same for every layer.
      layer_weights: the model's ``(stack name, transform)`` pairs (module doc).
      unroll: layers per trip of the scan.
      split_rngs: the rng streams drawn anew for each layer (besides ``params``).
    """
    weights = transform_of(layer_weights, name)
    if weights is not None and not scan:
        raise ValueError(f"stack {name}: its layers' weights are transformed only in a scan")
    body = remat_layer(layer, remat, static_argnums, in_scan=scan, weights=weights)
    if not scan:
        return [body(*args) for _ in range(length)]
    return nn.scan(
        body,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={stream: True for stream in ("params", *split_rngs)},
        in_axes=(nn.broadcast,) * broadcast,
        length=length,
        unroll=min(unroll, length),
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(*args, name=name)


def run(stack, x, *args):
    """``x`` through the layers of :func:`layer_stack`'s ``stack``, each given ``args``."""
    if isinstance(stack, Sequence):
        for layer in stack:
            x = layer(x, *args)
        return x
    x, _ = stack(x, *args)
    return x
