"""What the project reads of JAX that JAX does not promise to keep, in one table.

Everything else the project does with JAX goes through its public API. Two things
have no public form, and are read here only:

* **Private modules** (:data:`PRIVATE`, read by :func:`private`): which cluster
  ``jax.distributed.initialize()`` would join (its detectors), and the coordinator's
  key-value store, where a job's processes watch each other.
* **Primitive names and parameter keys of jaxprs** (:data:`ELEMENT_MOVES`,
  :data:`SUMMING_MOVES`, :data:`CAST`, :data:`CALLS`, :data:`CUSTOM_DERIVATIVES`):
  ``jax.make_jaxpr`` and a jaxpr's documented structure (``eqns``, ``invars``,
  ``outvars``, ``primitive.name``, ``params``, a variable's ``aval``: JAX's
  "Understanding jaxprs") are public, but which primitives exist and what their
  ``params`` are called is not: jax 0.11 replaced ``scan``'s ``num_consts`` and
  ``num_carry`` with ``ft_in``. The precision pass
  (:mod:`trainer.parallel.precision`) reads them through this table only: sub-jaxprs
  are found by type, not by key, and how a primitive's operands reach its sub-jaxprs
  is checked against their counts, so a primitive that changes shape is not followed
  (its parameters are gathered in their own dtype: the numbers stay right, only bytes
  are lost).

``tests/test_jax_internals.py`` resolves every private name and traces a function of
every kind in the table (scans, branches, loops, remats, jits, ``shard_map``, custom
derivatives) under the installed JAX, and fails naming the entry a release moved;
``tests/test_layout.py`` fails where a module outside this one reads ``jax._src``
or a jaxpr's ``params``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import jax

# What -> (module, attribute path) under jax._src.
PRIVATE = {
    "cluster types": ("jax._src.clusters", "ClusterEnv._cluster_types"),
    "on a Cloud TPU VM": ("jax._src.cloud_tpu_init", "running_in_cloud_tpu_vm"),
    # The coordinator's key-value store, where the job's processes watch each other
    # (trainer/command/peers.py).
    "distributed runtime client": ("jax._src.distributed", "global_state.client"),
}


def private(what: str):
    """The value of one of :data:`PRIVATE`, read now (tests patch them).

    Raises:
      RuntimeError: naming it and the JAX version, if this JAX has moved it.
    """
    module, attributes = PRIVATE[what]
    try:
        value = importlib.import_module(module)
        for attribute in attributes.split("."):
            value = getattr(value, attribute)
    except (ImportError, AttributeError) as e:
        raise RuntimeError(
            f"JAX {jax.__version__} has no {module}.{attributes}, which "
            f"trainer/jax_internals.py reads ({what}: {e}); use the JAX version "
            "pyproject.toml pins (to skip detecting the cluster: pass --coordinator_address, "
            "--num_processes and --process_id)"
        ) from e
    return value


# Primitive -> which operand positions have their elements moved or selected, never
# combined: reshape, transpose, slicing, gathering rows, sharding constraints.
ELEMENT_MOVES: dict[str, Callable[[int], bool]] = {
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

# Of those, the ones whose transpose adds cotangents up: a broadcast's sums its copies,
# a gather's scatter-adds rows that may repeat. A weight moved through one and then
# rounded has its gradient summed after the rounding if handed to the model rounded.
SUMMING_MOVES = frozenset({"broadcast_in_dim", "gather"})

# The cast, and the key of its target dtype.
CAST = ("convert_element_type", "new_dtype")

# Primitives that call sub-jaxprs -> how the operands reach them:
#   "same": operand i is input i of every sub-jaxpr (and output k is output k);
#   "after_index": operand 0 picks a branch, operand i + 1 is every branch's input i;
#   "loop": as "same", but the outputs feed the inputs of the next trip (a scan's
#     carry), so a value that reaches an output is not followed out.
# ``while`` is absent on purpose: its condition and body take different operands, and
# no model reads its parameters in one; absent primitives are not followed.
CALLS = {
    "jit": "same",
    "pjit": "same",  # the name of jit's primitive before jax 0.7
    "closed_call": "same",
    "core_call": "same",
    "remat2": "same",  # jax.checkpoint
    "checkpoint": "same",  # its name before jax 0.5
    "custom_jvp_call": "same",
    "custom_vjp_call": "same",
    "custom_vjp_call_jaxpr": "same",
    "shard_map": "same",
    "scan": "loop",
    "cond": "after_index",
}


# Calls whose derivative is the user's, not the transpose of their body: what they
# sum on the way back cannot be read from the jaxpr.
CUSTOM_DERIVATIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})


def sliced_per_trip(operand, body_input) -> bool:
    """Whether a loop's ``operand`` reaches its body ``body_input`` a slice at a time
    (a scan's ``xs``), told by shape: the body's input has the operand's shape less its
    leading dim, where a scan's constants and carries keep the operand's own shape.
    A slice's cotangent is written into its trip's row, never added across trips."""
    outer, inner = tuple(operand.aval.shape), tuple(body_input.aval.shape)
    return len(outer) == len(inner) + 1 and outer[1:] == inner


def cast_dtype(eqn) -> Any | None:
    """The dtype ``eqn`` casts to, or None if it is not a cast."""
    name, key = CAST
    return eqn.params[key] if eqn.primitive.name == name else None


def sub_jaxprs(eqn) -> Iterator[Any]:
    """The (open) jaxprs ``eqn``'s parameters hold, of whatever key: found by type."""
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            jaxpr = getattr(item, "jaxpr", item)  # a ClosedJaxpr's, or an open one
            if hasattr(jaxpr, "eqns") and hasattr(jaxpr, "invars"):
                yield jaxpr


def operand_map(eqn) -> list[tuple[Any, list[int | None], bool]] | None:
    """How ``eqn``'s operands reach the jaxprs it calls: ``(sub-jaxpr, operand index
    -> the sub-jaxpr's input index or None, whether it loops)`` for each; None where
    ``eqn`` calls none, or calls them in a way this table does not know."""
    how = CALLS.get(eqn.primitive.name)
    subs = list(sub_jaxprs(eqn))
    if how is None or not subs:
        return None
    n = len(eqn.invars)
    out = []
    for sub in subs:
        if how == "after_index":
            if len(sub.invars) != n - 1 or len(sub.outvars) != len(eqn.outvars):
                return None
            out.append((sub, [None, *range(n - 1)], False))
        else:
            if len(sub.invars) != n or len(sub.outvars) != len(eqn.outvars):
                return None
            out.append((sub, list(range(n)), how == "loop"))
    return out
