"""Which parameters may travel in bf16: a dataflow pass over the model's jaxpr.

Xu et al. 2020, section 4.2: with the weights kept sharded across steps, the
all-gather before the forward pass "can be performed in bfloat16" because the
matmuls and convolutions that consume the weights round them to bf16 anyway;
"this precision optimization is done automatically by a dataflow-based
precision propagation pass". This module is that pass.

A parameter is *low-precision consumed* when every path from it in the loss's
jaxpr reaches a ``convert_element_type`` to the low dtype through operations
that only move or select elements (reshape, transpose, slicing, gather of
rows, sharding constraints, calls into sub-jaxprs). Rounding such a parameter
before the gather changes nothing the model computes: round(take(t, ids)) ==
take(round(t), ids). Everything else - LayerNorm scales used in f32, tables
whose rows are looked up in f32 and rounded afterwards, anything returned or
used in arithmetic first - is gathered in its own dtype, so the policy never
changes the numbers, only the bytes moved.

Such a parameter is also *kept* low when nothing of its cotangent is summed before
the rounding: it has one use on every path, moved by no broadcast and no gather of
rows, and enters a loop only as a per-trip slice (a scan's stack, not a constant
used on every trip). The gathered weight is then handed to the model still
rounded: the gradient of the rounded value is the gradient the float32 one had
(the same low-precision cotangent, cast up), and no float32 copy of the gathered
weights is made. A stack cast back to float32 would be the layers' scan's
operand, rounded a layer at a time inside the loop: a float32 copy of the whole
stacked model held from the forward pass to the backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np

from trainer import jax_internals

# What a jaxpr's primitives are called and how their operands reach the jaxprs they
# call is JAX's to change: trainer/jax_internals.py holds it, checked by a test.
_MOVES = jax_internals.ELEMENT_MOVES


def _flows_into_low(
    jaxpr, var, low: np.dtype, returned: Callable[[int], bool], once: bool = False
) -> bool:
    """Whether every use of ``var`` in ``jaxpr`` (open) ends in a rounding to ``low``.

    ``returned(k)`` answers the same question for the k-th output of ``jaxpr``
    in its caller (a value passed through a sub-jaxpr is followed outside).
    ``once`` asks more: that nothing of ``var``'s cotangent is summed before the
    rounding, so that the gradient of the rounded value is the gradient of ``var``
    (one use, no move whose transpose sums, a loop's per-trip slices only, no
    derivative of the user's).
    """
    outputs = [k for k, out in enumerate(jaxpr.outvars) if out is var]
    uses = [(eqn, i) for eqn in jaxpr.eqns for i, x in enumerate(eqn.invars) if x is var]
    if not uses and not outputs:
        return False
    if once and len(uses) + len(outputs) > 1:
        return False
    if not all(returned(k) for k in outputs):
        return False
    for eqn, i in uses:
        if (dtype := jax_internals.cast_dtype(eqn)) is not None:
            if np.dtype(dtype) != low:
                return False
            continue
        name = eqn.primitive.name
        if name in _MOVES:
            if not _MOVES[name](i) or (once and name in jax_internals.SUMMING_MOVES):
                return False
            if not all(_flows_into_low(jaxpr, out, low, returned, once) for out in eqn.outvars):
                return False
            continue
        calls = jax_internals.operand_map(eqn)
        if calls is None or (once and name in jax_internals.CUSTOM_DERIVATIVES):
            return False
        for sub, mapping, loops in calls:
            if mapping[i] is None:
                return False
            inner = sub.invars[mapping[i]]
            # A loop's constant or carry is used on every trip: its cotangents add up.
            if once and loops and not jax_internals.sliced_per_trip(var, inner):
                return False

            def out_of_call(k, eqn=eqn, loops=loops):
                # A loop's outputs are its next trip's inputs too: not followed.
                return not loops and _flows_into_low(jaxpr, eqn.outvars[k], low, returned, once)

            if not _flows_into_low(sub, inner, low, out_of_call, once):
                return False
    return True


class Precision(NamedTuple):
    """Per parameter (trees of bools like the params):

    Attributes:
      low: the loss only ever uses it rounded to the low dtype, so it may be
        all-gathered in it.
      kept: also, nothing of its gradient is summed before the rounding, so the
        gathered weight may be handed to the model still rounded: the model
        computes the same numbers, and its gradient is the same low-precision
        cotangent that was cast up before (a subset of ``low``).
    """

    low: Any
    kept: Any


def params_precision(
    loss_fn: Callable[..., Any], abstract_params, *abstract_args, low_dtype
) -> Precision:
    """Which parameters ``loss_fn`` only ever uses rounded to ``low_dtype``, and of
    those which may reach it already rounded.

    Args:
      loss_fn: ``(params, *args) -> anything``; traced once, abstractly.
      abstract_params: pytree of arrays or ShapeDtypeStructs.
      *abstract_args: the other arguments (arrays or ShapeDtypeStructs).
      low_dtype: the gather dtype (bf16).

    Returns:
      :class:`Precision`. Parameters already in ``low_dtype`` or lower are False in
      both: there is nothing to round.
    """
    low = np.dtype(low_dtype)
    closed = jax.make_jaxpr(loss_fn)(abstract_params, *abstract_args)
    leaves, treedef = jax.tree.flatten(abstract_params)
    invars = closed.jaxpr.invars[: len(leaves)]

    def walk(var, once):
        return _flows_into_low(closed.jaxpr, var, low, lambda k: False, once)

    rounded = [
        np.dtype(leaf.dtype).itemsize > low.itemsize and walk(var, once=False)
        for leaf, var in zip(leaves, invars, strict=True)
    ]
    kept = [r and walk(var, once=True) for r, var in zip(rounded, invars, strict=True)]
    return Precision(jax.tree.unflatten(treedef, rounded), jax.tree.unflatten(treedef, kept))
