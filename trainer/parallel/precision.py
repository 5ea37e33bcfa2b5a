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
from jax.extend import core as jex_core

# Primitive -> the operand positions whose elements are moved, not combined.
_ELEMENT_MOVES: dict[str, Callable[[int], bool]] = {
    **{
        name: (lambda i: i == 0)
        for name in (
            "reshape",
            "transpose",
            "squeeze",
            "expand_dims",
            "broadcast_in_dim",
            "slice",
            "rev",
            "copy",
            "copy_p",
            "gather",
            "dynamic_slice",
            "sharding_constraint",
            "mesh_cast",
            "reshard",
            "reduce_precision",
        )
    },
    "concatenate": lambda i: True,
    "pad": lambda i: i == 0,
    "dynamic_update_slice": lambda i: i in (0, 1),
    "select_n": lambda i: i > 0,
}


def _sub_jaxprs(eqn) -> list[tuple[Any, list[int | None]]]:
    """(sub-jaxpr, operand index -> sub-jaxpr input index) of a call-like eqn."""
    params, name = eqn.params, eqn.primitive.name
    n = len(eqn.invars)
    identity = list(range(n))
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in params and name not in ("scan", "while", "cond"):
            return [(params[key], identity)]
    if name == "scan":
        # Operands: consts, carry, xs; the body takes them in that order, an xs operand
        # one slice per iteration (a stacked parameter of scanned layers: one layer's).
        # Consts and xs are followed; a carried parameter may come back modified, so
        # it is not.
        consts, carry = params["num_consts"], params["num_carry"]
        follow = [None if consts <= i < consts + carry else i for i in range(n)]
        return [(params["jaxpr"], follow)]
    if name == "cond":
        return [(branch, [None] + list(range(n - 1))) for branch in params["branches"]]
    return []


def _jaxpr_of(closed_or_open):
    return getattr(closed_or_open, "jaxpr", closed_or_open)


def _flows_into_low(jaxpr, var, low: np.dtype, returned: Callable[[int], bool]) -> bool:
    """Whether every use of ``var`` in ``jaxpr`` ends in a rounding to ``low``.

    ``returned(k)`` answers the same question for the k-th output of ``jaxpr``
    in its caller (a value passed through a sub-jaxpr is followed outside).
    """
    jaxpr = _jaxpr_of(jaxpr)
    outputs = [k for k, out in enumerate(jaxpr.outvars) if out is var]
    uses = [
        (eqn, i)
        for eqn in jaxpr.eqns
        for i, x in enumerate(eqn.invars)
        if isinstance(x, jex_core.Var) and x is var
    ]
    if not uses and not outputs:
        return False
    if not all(returned(k) for k in outputs):
        return False
    for eqn, i in uses:
        name = eqn.primitive.name
        if name == "convert_element_type":
            if np.dtype(eqn.params["new_dtype"]) != low:
                return False
            continue
        if name in _ELEMENT_MOVES:
            if not _ELEMENT_MOVES[name](i):
                return False
            if not all(_flows_into_low(jaxpr, out, low, returned) for out in eqn.outvars):
                return False
            continue
        subs = _sub_jaxprs(eqn)
        if not subs:
            return False
        for sub, mapping in subs:
            if mapping[i] is None:
                return False

            def out_of_call(k, eqn=eqn):
                if eqn.primitive.name == "scan" and k < eqn.params["num_carry"]:
                    return False  # carried into the next iteration: not followed
                return _flows_into_low(jaxpr, eqn.outvars[k], low, returned)

            if not _flows_into_low(sub, _jaxpr_of(sub).invars[mapping[i]], low, out_of_call):
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
