"""Logical-axis rules: resolution against the mesh and the loud errors."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

from trainer.parallel import mesh as mesh_lib
from trainer.parallel import rules as rules_lib

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", ("model",)))


class Dense(nn.Module):
    names: tuple = ("embed", "mlp")

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.ones, self.names)
        return x @ self.param("kernel", init, (4, 8))


def boxed(names=("embed", "mlp")):
    return jax.eval_shape(Dense(names).init, jax.random.PRNGKey(0), jnp.ones((2, 4)))["params"]


def test_rules_resolve_against_the_mesh():
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2})
    rules = rules_lib.resolve_rules(RULES, mesh)
    # The mesh always has a replica axis (of size 1 without shard_group_size).
    assert rules == (
        ("batch", ("replica", "data")),
        ("embed", None),
        ("mlp", "model"),
        ("vocab", "model"),
    )
    assert rules_lib.param_specs(boxed(), rules) == {"kernel": P(None, "model")}


def test_data_means_every_data_parallel_axis_with_groups():
    # Partial update sharding splits data into replica x data; batches still use both.
    mesh = mesh_lib.make_mesh({"data": -1}, shard_group_size=2)
    rules = rules_lib.resolve_rules((("batch", "data"),), mesh)
    assert rules == (("batch", ("replica", "data")),)
    assert rules_lib.without_data_axes(rules, mesh) == (("batch", None),)


def test_rule_naming_a_missing_mesh_axis_is_an_error():
    mesh = mesh_lib.make_mesh({"data": -1})
    with pytest.raises(rules_lib.ShardingRuleError, match="'mlp' maps to mesh axis 'model'"):
        rules_lib.resolve_rules((("mlp", "model"),), mesh)


def test_parameter_no_rule_covers_is_named():
    mesh = mesh_lib.make_mesh({"data": 4, "model": 2})
    rules = rules_lib.resolve_rules(RULES, mesh)
    with pytest.raises(
        rules_lib.ShardingRuleError,
        match="parameter kernel has logical axis 'heads' that no rule in config.mesh.rules covers",
    ):
        rules_lib.param_specs(boxed(("embed", "heads")), rules)


def test_parameter_without_logical_names_is_named():
    params = {"dense": {"bias": jax.ShapeDtypeStruct((8,), jnp.float32)}}
    with pytest.raises(rules_lib.ShardingRuleError, match="parameter dense/bias has no logical"):
        rules_lib.param_specs(params, ())
