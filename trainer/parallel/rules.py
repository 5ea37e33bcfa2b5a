"""Logical axis names -> mesh axes.

Models name the logical axes of every parameter and of key activations
("vocab", "embed", "batch", ...). The config maps each logical name to a mesh
axis or None. Sharding is data, not code: a parameter whose names no rule
covers is an error that names it, so no weight is silently replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import flax.linen as nn
import jax
from jax.sharding import Mesh

from trainer.errors import ConfigError
from trainer.parallel import mesh as mesh_lib

Rules = tuple[tuple[str, str | tuple[str, ...] | None], ...]


def param_name(path) -> str:
    """A parameter's (or any state leaf's) name from its tree path, the one spelling
    everything uses: ``"decoder_layers_0/mlp/wi/kernel"`` (the plan table,
    ``init_from_skip`` patterns, checkpoint messages)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


class ShardingRuleError(ConfigError):
    """A logical axis has no rule, or a rule names a missing mesh axis."""


def resolve_rules(rules: Iterable[Sequence], mesh: Mesh) -> Rules:
    """Checks the config's rules against the mesh and expands the data axis.

    With partial update sharding the mesh splits ``data`` into ``replica`` x
    ``data`` (see :mod:`trainer.parallel.mesh`); a rule that says ``data`` then means
    both, so that batches still spread over every data-parallel device.

    Args:
      rules: pairs ``(logical_name, mesh_axis_or_None)``.
      mesh: the device mesh.

    Returns:
      The rules as a tuple of pairs, with ``data`` expanded where needed.
    """
    out = []
    for logical, target in rules:
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        for axis in axes:
            if axis not in mesh.axis_names:
                raise ShardingRuleError(
                    f"mesh.rules: logical axis '{logical}' maps to mesh axis '{axis}', "
                    f"but the mesh has axes {mesh.axis_names}"
                )
        if mesh_lib.DATA_AXIS in axes:
            axes = tuple(
                a for ax in axes for a in (mesh_lib.data_axes(mesh) if ax == "data" else (ax,))
            )
        out.append((logical, axes[0] if len(axes) == 1 else (axes or None)))
    return tuple(out)


def without_data_axes(rules: Rules, mesh: Mesh) -> Rules:
    """The rules with data axes removed, for code vmapped over data replicas.

    Inside ``vmap(..., spmd_axis_name=data axes)`` the mapped dimension already
    carries the data axes, so the per-replica batch dimension must not.
    """
    drop = set(mesh_lib.data_axes(mesh))

    def strip(target):
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        kept = tuple(a for a in axes if a not in drop)
        return kept[0] if len(kept) == 1 else (kept or None)

    return tuple((logical, strip(target)) for logical, target in rules)


def param_specs(boxed_params, rules: Rules):
    """Mesh PartitionSpecs for a tree of flax-boxed (``nn.Partitioned``) params.

    Args:
      boxed_params: params as returned by ``model.init`` (possibly abstract),
        each leaf an ``nn.Partitioned`` carrying logical axis names.
      rules: resolved logical-axis rules.

    Returns:
      A tree of ``PartitionSpec`` matching the unboxed params.

    Raises:
      ShardingRuleError: naming the first parameter without logical names, or
        whose logical name no rule covers.
    """
    known = {logical for logical, _ in rules}

    def one(path, leaf):
        name = param_name(path)
        if not isinstance(leaf, nn.Partitioned):
            raise ShardingRuleError(
                f"parameter {name} has no logical axis names (create it with "
                f"nn.with_logical_partitioning)"
            )
        missing = [n for n in leaf.names if n is not None and n not in known]
        if missing:
            raise ShardingRuleError(
                f"parameter {name} has logical axis '{missing[0]}' that no rule in "
                f"config.mesh.rules covers"
            )
        return nn.logical_to_mesh_axes(leaf.names, rules)

    return jax.tree_util.tree_map_with_path(
        one, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )
