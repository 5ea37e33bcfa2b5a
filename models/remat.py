"""Activation rematerialisation per layer (``jax.checkpoint`` policies by name).

A model wraps each of its layers (Transformer layers, ResNet blocks) with
:func:`remat_layer`: the backward pass then recomputes what the policy does not
save instead of keeping it from the forward pass, trading FLOPs for memory.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from models import layer_weights

# Name -> what a layer keeps for its backward pass ("none": no remat at all).
POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,  # only the layer's inputs
    "dots": jax.checkpoint_policies.dots_saveable,  # matmul/conv outputs
    "dots_no_batch": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def remat_layer(
    layer: type[nn.Module],
    policy: str,
    static_argnums: tuple[int, ...],
    *,
    in_scan: bool = False,
    stack: str | None = None,
):
    """``layer`` as is for ``policy="none"``, else rematerialised under ``policy``.

    A layer of a stack whose weights are gathered a layer at a time
    (:mod:`models.layer_weights`: ``stack`` names it, and a transform is active) is
    rematerialised in any case: its gathered weights are never kept for the backward
    pass, which gathers them again (``"none"`` keeps the matmul outputs there, as
    ``"dots"``).

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
    gathered = stack is not None and layer_weights.active(stack) is not None
    if gathered:
        layer = layer_weights.in_stack(layer, stack)
    keep = POLICIES[policy]
    if keep is None and gathered:
        # Matmul outputs only: anything else a layer keeps may be its gathered weights
        # or a cast of them (a policy of names cannot tell a cast apart).
        keep = POLICIES["dots"]
    if keep is None:
        return layer
    return nn.remat(layer, policy=keep, static_argnums=static_argnums, prevent_cse=not in_scan)
