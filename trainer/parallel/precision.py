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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from trainer import jax_internals

# What a jaxpr's primitives are called and how their operands reach the jaxprs they
# call is JAX's to change: trainer/jax_internals.py holds it, checked by a test.
_MOVES = jax_internals.ELEMENT_MOVES


def _flows_into_low(jaxpr, var, low: np.dtype, returned: Callable[[int], bool]) -> bool:
    """Whether every use of ``var`` in ``jaxpr`` (open) ends in a rounding to ``low``.

    ``returned(k)`` answers the same question for the k-th output of ``jaxpr``
    in its caller (a value passed through a sub-jaxpr is followed outside).
    """
    outputs = [k for k, out in enumerate(jaxpr.outvars) if out is var]
    uses = [(eqn, i) for eqn in jaxpr.eqns for i, x in enumerate(eqn.invars) if x is var]
    if not uses and not outputs:
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
            if not _MOVES[name](i):
                return False
            if not all(_flows_into_low(jaxpr, out, low, returned) for out in eqn.outvars):
                return False
            continue
        calls = jax_internals.operand_map(eqn)
        if calls is None:
            return False
        for sub, mapping, loops in calls:
            if mapping[i] is None:
                return False

            def out_of_call(k, eqn=eqn, loops=loops):
                # A loop's outputs are its next trip's inputs too: not followed.
                return not loops and _flows_into_low(jaxpr, eqn.outvars[k], low, returned)

            if not _flows_into_low(sub, sub.invars[mapping[i]], low, out_of_call):
                return False
    return True


def low_precision_params(
    loss_fn: Callable[..., Any], abstract_params, *abstract_args, low_dtype
) -> Any:
    """For each parameter, whether ``loss_fn`` only ever uses it rounded to ``low_dtype``.

    Args:
      loss_fn: ``(params, *args) -> anything``; traced once, abstractly.
      abstract_params: pytree of arrays or ShapeDtypeStructs.
      *abstract_args: the other arguments (arrays or ShapeDtypeStructs).
      low_dtype: the gather dtype (bf16).

    Returns:
      A pytree of bools shaped like ``abstract_params``. Parameters already in
      ``low_dtype`` or lower are False: there is nothing to round.
    """
    low = np.dtype(low_dtype)
    closed = jax.make_jaxpr(loss_fn)(abstract_params, *abstract_args)
    leaves, treedef = jax.tree.flatten(abstract_params)
    invars = closed.jaxpr.invars
    flags = [
        np.dtype(leaf.dtype).itemsize > low.itemsize
        and _flows_into_low(closed.jaxpr, var, low, lambda k: False)
        for leaf, var in zip(leaves, invars[: len(leaves)], strict=True)
    ]
    return jax.tree.unflatten(treedef, flags)
