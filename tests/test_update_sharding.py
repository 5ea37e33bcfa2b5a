"""Weight-update sharding: layouts, numerical equivalence, state shardings, HLO.

Equivalence tolerance: ``wus`` and ``fsdp`` sum gradients with reduce-scatter
(plus an all-reduce across groups for partial sharding) where ``none`` uses one
all-reduce, so f32 sums are added in another order. After 20 steps parameters
(of order 1) agree to 5e-5 absolute; the layouts themselves add no error.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import common
from trainer import hlo, optimizers, shard_layout
from trainer import mesh as mesh_lib
from trainer import update_sharding as us

SHAPES = {"scalar": (), "bias": (10,), "odd": (7, 13), "conv": (3, 3, 256, 256), "mat": (64, 48)}
STEPS = 20
ATOL = 5e-5


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), len(SHAPES))
    return {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, SHAPES.items(), strict=True)}


def _specs(mesh):
    specs = {n: P() for n in SHAPES}
    if mesh.shape.get("model", 1) > 1:
        specs["mat"] = P(None, "model")
        specs["conv"] = P(None, None, None, "model")
    return specs


def _optimizer(name, params):
    cfg = common.base_config().optimizer
    cfg.update(name=name, learning_rate=0.01, weight_decay=0.01)
    return optimizers.make_optimizer(cfg, params, STEPS)[0]


def _mesh(case):
    if case == "data8":
        return mesh_lib.make_mesh({"data": -1})
    if case == "data4_model2":
        return mesh_lib.make_mesh({"data": 4, "model": 2})
    if case == "devices6":
        return mesh_lib.make_mesh({"data": -1}, devices=jax.devices()[:6])
    group = int(case.removeprefix("group"))
    return mesh_lib.make_mesh({"data": -1}, shard_group_size=group)


def _train(mode, opt_name, mesh):
    """20 steps of random per-replica gradients (plus a term in the params, so
    trust ratios and weight decay matter); returns logical params and state."""
    params = _params()
    plan = us.make_plan(params, _specs(mesh), mesh, mode=mode, min_shard_bytes=0)
    tx = us.weight_update_sharding(_optimizer(opt_name, params), plan)
    replicas = mesh_lib.data_parallel_size(mesh)
    rows = NamedSharding(mesh, P(mesh_lib.data_axes(mesh)))

    def run(params):
        stored = plan.to_stored(params)
        state = tx.init(stored)

        def step(carry, i):
            stored, state = carry
            # Different on every replica and step, but correlated across replicas as
            # real gradients are (sums that cancel to ~0 make Adam's g / sqrt(v)
            # amplify rounding); cheap to make (no PRNG on CPU).
            replica = 0.3 * jnp.arange(replicas, dtype=jnp.float32)
            grads = {
                n: jax.lax.with_sharding_constraint(
                    0.1 * jnp.sin(p[None] * (1.0 + 0.1 * i) + replica.reshape(-1, *[1] * p.ndim))
                    + 0.01 * p,
                    rows,
                )
                for n, p in plan.to_logical(stored).items()
            }
            updates, state = tx.update(grads, state, stored)
            return (optax.apply_updates(stored, updates), state), None

        (stored, state), _ = jax.lax.scan(step, (stored, state), jnp.arange(STEPS))
        return plan.to_logical(stored), stored, state

    with jax.set_mesh(mesh):
        logical, stored, state = jax.jit(run)(params)
    return logical, stored, state, plan


MESHES = ["data8", "data4_model2", "devices6", "group2", "group4"]
OPTIMIZERS = ["sgd", "momentum", "adam", "adamw", "lamb", "lars"]


@pytest.mark.parametrize("opt_name", OPTIMIZERS)
def test_sharded_update_matches_replicated(opt_name):
    for case in MESHES:
        mesh = _mesh(case)
        reference = _train("none", opt_name, mesh)[0]
        modes = ["wus", "fsdp"] if not case.startswith("group") else ["wus"]
        for mode in modes:
            got = _train(mode, opt_name, mesh)[0]
            for name in SHAPES:
                np.testing.assert_allclose(
                    got[name], reference[name], atol=ATOL, rtol=0,
                    err_msg=f"{opt_name} {mode} on {case}: {name}",
                )  # fmt: skip
            # Training moved the weights, so agreement is not trivial.
            assert float(jnp.abs(got["mat"] - _params()["mat"]).max()) > 1e-3


@pytest.mark.parametrize(
    "shape, shards, stored, pad",
    [
        ((), 8, (), 0),
        ((10,), 8, (16,), 6),
        ((10,), 6, (12,), 2),
        ((7, 13), 8, (96,), 5),
        ((7, 13), 6, (96,), 5),
        ((3, 3, 256, 256), 8, (3, 3, 256, 256), 0),
        ((3, 3, 256, 256), 6, (3, 768, 256), 0),
        # No run divides by 10; merging 3x256x256 pads 2 zeros (6 elements in all).
        ((3, 3, 256, 256), 10, (3, 196610), 2),
    ],
)
def test_layout_choice(shape, shards, stored, pad):
    lay = shard_layout.choose_layout(shape, P(), shards, min_shard_bytes=0)
    assert lay.stored_shape == stored
    assert lay.pad == pad
    assert lay.sharded == (shape != ())


def test_layout_respects_model_sharding_and_threshold():
    lay = shard_layout.choose_layout((64, 48), P(None, "model"), 8, min_shard_bytes=0)
    assert lay.stored_spec() == P("data", "model")
    assert (
        shard_layout.choose_layout((64, 48), P(), 8, min_shard_bytes=64 * 48 * 4 + 1).sharded
        is False
    )
    assert shard_layout.choose_layout((64, 48), P(), 8, min_shard_bytes=64 * 48 * 4).sharded is True


def test_round_trip_is_exact():
    params = _params()
    mesh = _mesh("devices6")
    plan = us.make_plan(params, _specs(mesh), mesh, mode="wus", min_shard_bytes=0)
    with jax.set_mesh(mesh):
        back = jax.jit(lambda p: plan.to_logical(plan.to_stored(p)))(params)
    for name in SHAPES:
        np.testing.assert_array_equal(back[name], params[name])


@pytest.mark.parametrize("opt_name", ["adam", "lamb"])
def test_state_stays_sharded_and_small(opt_name):
    mesh = _mesh("data8")
    _, stored, state, plan = _train("wus", opt_name, mesh)
    expected = plan.stored_shardings()
    for name in SHAPES:
        assert stored[name].sharding.is_equivalent_to(expected[name], stored[name].ndim)
    param_like = 0
    for leaf, sharding in zip(
        jax.tree.leaves(state), jax.tree.leaves(plan.state_shardings(state)), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        if leaf.ndim and leaf.sharding.spec != P():
            param_like += 1
    assert param_like >= 2 * (len(SHAPES) - 1)  # mu and nu of every sharded param

    # Per-device bytes: 1/8 of the (padded) total, for every sharded state leaf.
    def per_device(tree):
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    def total(tree):
        return sum(x.nbytes for x in jax.tree.leaves(tree))

    sharded_state = [x for x in jax.tree.leaves(state) if x.sharding.spec != P()]
    assert per_device(sharded_state) * 8 == total(sharded_state)
    padding = sum(math.prod(s) for s in [(16,), (96,)]) - (10 + 91)
    logical = sum(4 * math.prod(SHAPES[n]) for n in SHAPES if n != "scalar")
    assert total(stored) - 4 == logical + 4 * padding


def test_hlo_gathers_bf16_weights_and_reduce_scatters_f32():
    mesh = _mesh("data8")
    params = _params()
    plan = us.make_plan(params, _specs(mesh), mesh, mode="wus", min_shard_bytes=0)
    tx = us.weight_update_sharding(optax.adam(1e-3), plan)

    def loop(stored, state, x):
        def step(carry, x):
            stored, state = carry
            weights = plan.gather(stored)
            grads = jax.vmap(
                jax.grad(lambda w, x: sum(jnp.sum(jnp.sin(v) * x) for v in jax.tree.leaves(w))),
                in_axes=(None, 0),
                spmd_axis_name=mesh_lib.data_axes(mesh),
            )(weights, x)
            updates, state = tx.update(grads, state, stored)
            return (optax.apply_updates(stored, updates), state), None

        return jax.lax.scan(step, (stored, state), x)[0]

    with jax.set_mesh(mesh):
        stored = jax.jit(plan.to_stored, out_shardings=plan.stored_shardings())(params)
        state = jax.jit(tx.init)(stored)
        x = jnp.ones((4, 8), jnp.bfloat16)
        _, text = hlo.compile_with_dump(jax.jit(loop).lower(stored, state, x))
    found = [c for c in hlo.collectives(text, 8) if c.in_loop]
    sharded = [
        lay
        for lay in jax.tree.leaves(
            plan.layouts, is_leaf=lambda x: isinstance(x, shard_layout.LeafLayout)
        )
        if lay.sharded
    ]
    # One bf16 all-gather per sharded weight, of the whole weight, and no f32
    # gather at all (neither weights nor Adam state); one f32 reduce-scatter each.
    gathers = sorted(c.result_bytes for c in found if c.kind == "all-gather")
    assert gathers == sorted(2 * math.prod(lay.stored_shape) for lay in sharded)
    assert {c.dtype for c in found if c.kind == "all-gather"} == {"bf16"}
    scatters = sorted(c.result_bytes for c in found if c.kind == "reduce-scatter")
    assert scatters == sorted(4 * math.prod(lay.stored_shape) // 8 for lay in sharded)
    assert {c.dtype for c in found if c.kind == "reduce-scatter"} == {"f32"}
    # Only the replicated scalar is all-reduced.
    assert [c.result_bytes for c in found if c.kind == "all-reduce"] == [4]


def test_unknown_mode_is_rejected():
    mesh = _mesh("data8")
    with pytest.raises(ValueError, match="update_sharding must be one of"):
        us.make_plan(_params(), _specs(mesh), mesh, mode="zero3")
