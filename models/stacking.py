"""Parameters of one layer layout made from another's: one module per layer
(``encoder_layers_3/mlp/wi/kernel``, flax's names for a list of modules) or a stack of
layers scanned over (``encoder_layers/mlp/wi/kernel``, one leaf ``[layers, ...]``).

Parameter names and shapes alone decide, by two rules, so any model that names its
layers so converts (a scanned Transformer starts from the values of an unscanned one;
``init_from`` and ``trainer.export`` convert checkpoints):

* a wanted ``P/rest`` of shape ``[n, *s]`` that the source lacks is stacked from the
  source's ``P_0/rest`` ... ``P_{n-1}/rest``, each of shape ``s``;
* a wanted ``P_i/rest`` of shape ``s`` that the source lacks is slice ``i`` of its
  ``P/rest``, of shape ``[n, *s]`` with ``i < n``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

_LAYER = re.compile(r"^(.*)_(\d+)$")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one wanted parameter comes from in the source.

    Attributes:
      names: one name (taken as it is, or sliced at ``index``), or the names to
        stack, in order, on a new leading dim (``stacked``: a stack of one layer too).
      index: the layer to take out of a stacked source leaf, or None.
      stacked: whether ``names`` are stacked into the wanted parameter.
    """

    names: tuple[str, ...]
    index: int | None = None
    stacked: bool = False  # the names are stacked on a new leading dim (one or more)


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(leaf.shape)


def match(wanted: Mapping[str, Any], have: Mapping[str, Any]) -> dict[str, Source]:
    """For each wanted parameter the source can give, where it comes from (names not
    in the result are missing from the source, or of another shape there).

    Args:
      wanted: ``{name: leaf with .shape}`` of the model (flat, "/"-joined names).
      have: the same of the source.
    """
    found = {}
    for name, leaf in wanted.items():
        shape = _shape(leaf)
        if name in have:
            if _shape(have[name]) == shape:
                found[name] = Source((name,))
            continue
        top, _, rest = name.partition("/")
        # Stack the source's per-layer leaves.
        layers = [f"{top}_{i}/{rest}" for i in range(shape[0])] if shape else []
        if layers and all(n in have and _shape(have[n]) == shape[1:] for n in layers):
            found[name] = Source(tuple(layers), stacked=True)
            continue
        # Take one layer out of the source's stack.
        per_layer = _LAYER.match(top)
        stack = f"{per_layer[1]}/{rest}" if per_layer else None
        if stack in have and _shape(have[stack])[1:] == shape:
            index = int(per_layer[2])
            if index < _shape(have[stack])[0]:
                found[name] = Source((stack,), index)
    return found


def assemble(sources: Mapping[str, Source], have: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
    """The wanted parameters (the names of ``sources``, :func:`match`) from the source's
    leaves ``have``, stacked or sliced as ``sources`` says."""
    out = {}
    for name, source in sources.items():
        if source.stacked:
            out[name] = jnp.stack([have[n] for n in source.names])
        elif source.index is not None:
            out[name] = have[source.names[0]][source.index]
        else:
            out[name] = have[source.names[0]]
    return out


def unbox_unconstrained(tree):
    """``tree`` with Flax's partitioning boxes removed, their sharding constraints not
    applied (``nn.unbox`` constrains each value to its logical spec, replicated over
    the data axis: inside an initialiser that makes every device draw every tensor
    whole; the caller places the values instead)."""
    import flax.linen as nn  # noqa: PLC0415  (this module is otherwise plain JAX)

    return jax.tree.map(
        lambda x: x.unbox(apply_constraint=False) if isinstance(x, nn.Partitioned) else x,
        tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )


def init_like_unscanned(scanned, unscanned, rngs, *args, **kwargs) -> dict:
    """``scanned.init(rngs, *args, **kwargs)``'s variables, with the values of
    ``unscanned.init`` (the same model, one module per layer): a layer stack is a
    layout of the parameters, not another model, so both start from the same numbers.
    The result keeps the scanned model's boxes (logical axis names, ``"layers"``)."""
    import flax.linen as nn  # noqa: PLC0415  (this module is otherwise plain JAX)
    from flax import traverse_util  # noqa: PLC0415

    variables = unscanned.init(rngs, *args, **kwargs)
    boxed = jax.eval_shape(lambda: scanned.init(rngs, *args, **kwargs))["params"]
    wanted = traverse_util.flatten_dict(nn.unbox(boxed), sep="/")
    values = traverse_util.flatten_dict(unbox_unconstrained(variables["params"]), sep="/")
    stacked = assemble(match(wanted, values), values)
    flat_boxes = traverse_util.flatten_dict(boxed, sep="/")
    return {
        "params": traverse_util.unflatten_dict(
            {n: box.replace_boxed(stacked[n]) for n, box in flat_boxes.items()}, sep="/"
        )
    }
