"""Activation rematerialisation per layer (``jax.checkpoint`` policies by name).

A model wraps each of its layers (Transformer layers, ResNet blocks) with
:func:`remat_layer`: the backward pass then recomputes what the policy does not
save instead of keeping it from the forward pass, trading FLOPs for memory.
"""

from __future__ import annotations

import flax.linen as nn
import jax

# Name -> what a layer keeps for its backward pass ("none": no remat at all).
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul/conv outputs
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_layer(
    layer: type[nn.Module], policy: str, static_argnums: tuple[int, ...], *, in_scan: bool = False
):
    """``layer`` as is for ``policy="none"``, else rematerialised under ``policy``.

    Args:
      layer: a flax Module class.
      policy: a key of :data:`POLICIES`.
      static_argnums: positions of the call's non-array arguments (``self`` is 0),
        e.g. a ``train`` flag, which must be passed positionally.
      in_scan: the layer is the body of a ``scan`` (stacked layers). A scan already
        keeps XLA from merging the recomputation back into the forward pass, so the
        barriers that ``prevent_cse`` adds would only cost time there.
    """
    if policy not in POLICIES:
        raise ValueError(f"remat must be one of {sorted(POLICIES)}, got '{policy}'")
    if policy == "none":
        return layer
    return nn.remat(
        layer, policy=POLICIES[policy], static_argnums=static_argnums, prevent_cse=not in_scan
    )
