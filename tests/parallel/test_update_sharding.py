"""Weight-update sharding: layouts, the optax contract, state shardings, and the
collectives of the real train step.

The step's numbers against plain optax are in ``test_wus_step.py``.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import COMPILATION_CACHE as _SUITE_CACHE
from conftest import set_compilation_cache
from conftest import tiny_wus as tiny
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from configs import llama
from trainer.analysis import hlo
from trainer.errors import ConfigError
from trainer.parallel import layout as layout_lib
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import plan as us
from trainer.parallel import transform as ut
from trainer.training import experiment

DATA8 = {"data": 8, "model": 1}


@pytest.mark.parametrize(
    "shape, spec, shards, sizes, stored, how",
    [
        # Leading dims merged, the minor dim kept: contiguous shards, no padding.
        ((3, 3, 256, 256), P(), 8, DATA8, (1, 1, 2304, 256), "merged dims 3x3x256"),
        # Paper 4.1's counterexample: pad the (merged) major dim, never the minor
        # ones; the minor dim splits only into whole rows of 128 lanes.
        ((3, 3, 256, 256), P(), 10, DATA8, (1, 1, 4610, 128), "merged dims 3x3x256x256 in rows"),
        ((7, 13), P(), 8, DATA8, (8, 13), "dim 0"),
        ((10,), P(), 6, DATA8, (12,), "dim 0"),
        # A model axis of size 1 does not take a dim: rows of 128 lanes divide evenly,
        # where dim 1 would double (the 2048-core Transformer's embedding).
        (
            (32000, 1024),
            P("model"),
            2048,
            {"data": 2048, "model": 1},
            (256000, 128),
            "merged dims 32000x1024 in rows",
        ),
        ((4096, 1024), P("model"), 2048, {"data": 2048, "model": 1}, (4096, 1024), "dim 0"),
        # data joins the dim model splits where that needs no padding ...
        ((2, 8192), P(None, "model"), 8, {"data": 8, "model": 2}, (2, 8192), "dim 1 (with model)"),
        ((4096,), P("model"), 8, {"data": 8, "model": 2}, (4096,), "dim 0 (with model)"),
        # ... and another dim stays free for data when model takes one.
        ((64, 48), P(None, "model"), 4, {"data": 4, "model": 2}, (64, 48), "dim 0"),
    ],
)
def test_layout_choice(shape, spec, shards, sizes, stored, how):
    lay = layout_lib.choose_layout(shape, spec, shards, axis_sizes=sizes)
    assert lay.sharded and lay.stored_shape == stored
    assert lay.describe().startswith(how), lay.describe()
    assert len(lay.stored_shape) == len(shape)  # the logical rank is kept
    assert lay.padding <= 0.25


def test_layout_stored_specs():
    joined = layout_lib.choose_layout(
        (2, 8192), P(None, "model"), 8, axis_sizes={"data": 8, "model": 2}
    )
    assert joined.stored_spec() == P(None, ("model", "data"))
    assert joined.stored_spec(gathered=True) == P(None, "model")
    merged = layout_lib.choose_layout((3, 3, 256, 256), P(), 8, axis_sizes=DATA8)
    assert merged.stored_spec() == P(None, None, "data", None)
    assert merged.logical_spec() == P(None, None, None, None)


def test_minor_dim_is_merged_only_in_rows_of_128():
    # (2, 8192) over 8: 300% padding on dim 0; the minor dim joins the merge in
    # whole rows of 128 lanes (a bitcast on TPU), keeping the shards contiguous.
    lay = layout_lib.choose_layout((2, 8192), P(), 8, axis_sizes=DATA8)
    assert (
        lay.describe() == "merged dims 2x8192 in rows of 128 -> (128, 128) over data, pad 0 (0.0%)"
    )
    # The Transformer's attention output kernel at 2048 shards (1024 rows would pad 100%).
    lay = layout_lib.choose_layout(
        (16, 64, 1024), P("heads"), 2048, axis_sizes={"data": 2048, "heads": 1}
    )
    assert lay.stored_shape == (1, 8192, 128) and lay.stored_spec() == P(None, "data", None)
    # A minor dim that is no multiple of 128 is never merged.
    assert layout_lib.choose_layout((2, 100), P(), 8, axis_sizes=DATA8).stored_shape == (2, 104)


def test_unprofitable_layouts_stay_replicated():
    lay = layout_lib.choose_layout((10,), P(), 8, axis_sizes=DATA8)
    assert not lay.sharded and "pads under 25%" in lay.reason
    # min_shard_bytes counts the bytes per device, in the parameter's own dtype,
    # after model sharding.
    kw = dict(axis_sizes={"data": 4, "model": 2}, min_shard_bytes=64 * 48 * 2 // 2)
    assert layout_lib.choose_layout((64, 48), P(None, "model"), 4, itemsize=2, **kw).sharded
    kw["min_shard_bytes"] += 1
    assert not layout_lib.choose_layout((64, 48), P(None, "model"), 4, itemsize=2, **kw).sharded


# Over 6 shards: "odd" is padded 11 -> 12 rows, "conv" merged to (1, 1, 144, 16).
SHAPES = {"bias": (12,), "odd": (11, 13), "conv": (3, 3, 16, 16), "mat": (60, 48), "tiny": ()}


def _params():
    keys = jax.random.split(jax.random.PRNGKey(0), len(SHAPES))
    return {n: jax.random.normal(k, s) for k, (n, s) in zip(keys, SHAPES.items(), strict=True)}


def _plan(mesh=None, **kw):
    mesh = mesh or mesh_lib.make_mesh({"data": -1}, devices=jax.devices()[:6])
    return us.make_plan(
        _params(), jax.tree.map(lambda _: P(), _params()), mesh, min_shard_bytes=0, **kw
    )


def test_round_trip_is_exact():
    plan = _plan()
    assert {n: lay.reformatted for n, lay in plan.layouts.items()} == {
        "bias": False,
        "odd": True,
        "conv": True,
        "mat": False,
        "tiny": False,
    }
    assert plan.layouts["odd"].pad == 1 and plan.layouts["conv"].stored_shape == (1, 1, 144, 16)
    with jax.set_mesh(plan.mesh):
        back = jax.jit(lambda p: plan.to_logical(plan.to_stored(p)))(_params())
    for name, value in _params().items():
        np.testing.assert_array_equal(back[name], value)


def _run_optax(build, plan, steps=4):
    """An optax composition on reduced gradients, twice: built around
    ``weight_update_sharding`` on the stored layout, and plain on the logical params.

    Args:
      build: ``wrap -> GradientTransformation``; ``wrap(inner)`` is where the
        composition puts weight-update sharding (the identity for the plain one).
    """
    grads = [
        jax.tree.map(lambda p, k=k: jnp.sin(p * (1 + k)) + 0.01 * p, _params())
        for k in range(steps)
    ]
    plain_tx = build(lambda inner: inner)
    sharded_tx = build(lambda inner: ut.weight_update_sharding(inner, plan))

    def plain(params):
        state = plain_tx.init(params)
        for g in grads:
            updates, state = plain_tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
        return params

    def sharded(params):
        stored = plan.to_stored(params)
        state = sharded_tx.init(stored)
        for g in grads:
            updates, state = sharded_tx.update(plan.to_stored(g), state, stored)
            stored = optax.apply_updates(stored, updates)
        return plan.to_logical(stored), stored, state

    want = jax.jit(plain)(_params())
    with jax.set_mesh(plan.mesh):
        got, stored, state = jax.jit(sharded)(_params())
    return want, got, stored, state, sharded_tx


def _ndim_mask(tree):
    return jax.tree.map(lambda p: p.ndim > 1, tree)


COMPOSITIONS = {
    "clip then wus(adam)": lambda w: optax.chain(
        optax.clip_by_global_norm(0.1), w(optax.adam(1e-2))
    ),
    "wus(inject_hyperparams(adamw, callable mask))": lambda w: w(
        optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.1, mask=_ndim_mask)
    ),
    "MultiSteps(wus(lamb))": lambda w: optax.MultiSteps(w(optax.lamb(1e-2)), every_k_schedule=2),
    "wus(lars)": lambda w: w(
        optax.lars(
            1e-2, weight_decay=0.1, weight_decay_mask=_ndim_mask, trust_ratio_mask=_ndim_mask
        )
    ),
}


@pytest.mark.parametrize("name", sorted(COMPOSITIONS))
def test_composes_as_optax_users_expect(name):
    plan = _plan()
    want, got, stored, state, tx = _run_optax(COMPOSITIONS[name], plan)
    for key in SHAPES:
        np.testing.assert_allclose(got[key], want[key], atol=2e-6, rtol=0, err_msg=key)
    moved = max(float(np.abs(want[k] - _params()[k]).max()) for k in SHAPES)
    assert moved > 1e-2
    # Padding stays zero, and param-shaped state (moments, MultiSteps'
    # accumulators) stays in its parameter's sharding.
    odd = plan.layouts["odd"]
    assert not np.any(np.asarray(stored["odd"])[odd.shape[0] :])
    shardings = plan.state_shardings(tx, state)
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert any(s.spec != P() for s in jax.tree.leaves(shardings))


@pytest.mark.parametrize(
    "inner",
    [
        optax.adafactor(1e-2, min_dim_size_to_factor=4),  # row means over 12 rows, not 11
        optax.adamw(1e-2, mask=lambda t: jax.tree.map(lambda p: p.shape[:1] == (11,), t)),
    ],
    ids=["adafactor", "shape_mask"],
)
def test_shape_dependent_optimizers_are_refused(inner):
    plan = _plan()
    ut.weight_update_sharding(inner, plan)  # building computes nothing: the check is
    with pytest.raises(ConfigError, match="update of parameter (conv|odd) depends on its shape"):
        ut.check_layout_agnostic(inner, plan)  # experiment.build's, once per run


def test_state_dtype_and_bf16_params():
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), _params())
    mesh = mesh_lib.make_mesh({"data": -1})
    plan = us.make_plan(params, jax.tree.map(lambda _: P(), params), mesh, min_shard_bytes=0)
    tx = ut.weight_update_sharding(optax.adam(1e-2), plan, state_dtype=jnp.float32)

    def run(params):
        stored = plan.to_stored(params)
        state = tx.init(stored)

        def step(carry, _):
            stored, state = carry
            grads = jax.tree.map(lambda p: jnp.cos(p.astype(jnp.float32)).astype(p.dtype), stored)
            updates, state = tx.update(grads, state, stored)
            return (optax.apply_updates(stored, updates), state), None

        return jax.lax.scan(step, (stored, state), None, length=3)[0]  # the carry keeps dtypes

    with jax.set_mesh(mesh):
        stored, state = jax.jit(run)(params)
    assert {x.dtype for x in jax.tree.leaves(stored)} == {jnp.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}


def test_unknown_mode_is_rejected():
    with pytest.raises(ConfigError, match="update_sharding must be one of"):
        _plan(mode="zero3")


# ------------------------------------------------- collectives of the real step


@pytest.fixture(autouse=True)
def _without_compilation_cache(without_compilation_cache):
    """The suite compiles through a persistent cache (conftest.py); a hit dumps no HLO."""


def test_a_cache_hit_is_named_not_parsed(tmp_path):
    """With the cache on, the second compile of a program dumps nothing: said, not empty."""
    set_compilation_cache(True)
    jax.config.update("jax_compilation_cache_dir", str(tmp_path))
    try:
        mesh = mesh_lib.make_mesh({"data": -1})
        x = jax.device_put(jnp.arange(64.0), NamedSharding(mesh, P("data")))
        lowered = jax.jit(lambda x: x * 2 + jnp.sum(x)).lower(x)
        hlo.compile_with_dump(lowered)
        with pytest.raises(RuntimeError, match="persistent compilation cache"):
            hlo.compile_with_dump(lowered)
    finally:
        jax.config.update("jax_compilation_cache_dir", _SUITE_CACHE)
        set_compilation_cache(False)


def _step_collectives(mode, mesh="data8", accumulate=1):
    config = tiny(mode, "adam", mesh=mesh, dtype="bfloat16", accumulate=accumulate)
    # Kernels (>= 4 KiB) are sharded; LayerNorm parameters and biases stay replicated.
    config.optimizer.min_shard_bytes = 1024
    exp = experiment.build(config)
    _, text = hlo.compile_with_dump(experiment.lower_loop(exp, 2))
    layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "stored_shape"))
    low = jax.tree.leaves(exp.plan.low_precision)
    return exp, layouts, low, [c for c in hlo.collectives(text, 8) if c.in_loop]


def _check_weight_collectives(exp, layouts, low, found, *, gathers_per_step, depth):
    data = exp.mesh.shape["data"]

    def local(lay):  # elements of the stored tensor on one device, before the data split
        return math.prod(lay.stored_shape) // math.prod(
            exp.mesh.shape[a] for axes in lay.spec for a in axes
        )

    sharded = [(lay, lo) for lay, lo in zip(layouts, low, strict=True) if lay.sharded]
    assert sharded and all(lo for _, lo in sharded)  # every kernel travels in bf16
    over_data = [c for c in found if c.group_size == data]
    gathers = [c for c in over_data if c.kind == "all-gather"]
    # bf16, gathered as its bits on CPU (collectives.gathers_bits).
    assert {(c.dtype, c.loop_depth) for c in gathers} == {("u16", depth)}
    assert sorted(c.result_bytes for c in gathers) == sorted(
        2 * local(lay) for lay, _ in sharded for _ in range(gathers_per_step)
    )
    scatters = [c for c in over_data if c.kind == "reduce-scatter"]
    assert {(c.dtype, c.loop_depth) for c in scatters} == {("f32", depth)}
    assert sorted(c.result_bytes for c in scatters) == sorted(
        4 * local(lay) // data for lay, _ in sharded
    )
    # No sharded weight's gradient is all-reduced: all-reduces are of replicated
    # parameters' gradients, or scalars (losses, norms).
    replicated = {4 * math.prod(lay.shape) for lay in layouts if not lay.sharded}
    sharded_sizes = {4 * math.prod(lay.shape) for lay, _ in sharded}
    for c in found:
        if c.kind == "all-reduce" and c.group_size >= data:
            assert c.result_bytes <= 8 or c.result_bytes in replicated, c
            assert c.result_bytes not in sharded_sizes - replicated, c


@pytest.mark.parametrize("mesh", ["data8", "data4_model2"])
def test_wus_step_collectives(mesh):
    exp, layouts, low, found = _step_collectives("wus", mesh)
    assert not [c for c in found if c.kind in ("all-to-all", "collective-permute")], found
    _check_weight_collectives(exp, layouts, low, found, gathers_per_step=1, depth=1)
    # Model parallelism adds activation collectives over the model axis only.
    others = [c for c in found if c.group_size not in (exp.mesh.shape["data"], 8)]
    assert all(c.group_size == exp.mesh.shape["model"] for c in others)
    assert bool(others) == (mesh == "data4_model2")


@pytest.mark.slow  # a step's compile: 10-17 s
def test_per_layer_looks_rows_up_in_an_untied_table_without_gathering_it():
    # The CPU program of a step: the input table stays sharded, its rows come by
    # all-to-all; the output table is gathered and its gradient reduce-scattered.
    config = llama.get_config("tiny,synthetic")
    config.model.update(tie_embeddings=False, num_layers=2)
    config.optimizer.update(update_sharding="per_layer", min_shard_bytes=0)
    exp = experiment.build(config, with_data=False)
    _, text = hlo.compile_with_dump(experiment.lower_loop(exp, 2))
    found = [c for c in hlo.collectives(text, 8) if c.in_loop]
    table = exp.plan.layouts["token_embedding"]["embedding"]
    assert table.sharded and table.stored_shape[0] % 8 == 0
    vocab, emb = table.shape
    tokens = config.global_batch_size // 8 * config.data.max_length  # a replica's

    def elements(c):
        return c.result_bytes // {"bf16": 2, "u16": 2, "f32": 4, "s32": 4}[c.dtype]

    tables = [c for c in found if c.kind == "all-gather" and elements(c) == vocab * emb]
    assert len(tables) == 1, found  # the output table's; the input table's is not gathered
    trades = sorted(elements(c) for c in found if c.kind == "all-to-all")
    # Forward: the table's columns, then the rows; backward: the rows' cotangents, then
    # the columns' gradient.
    assert trades == sorted([vocab * emb // 8, tokens * emb] * 2), trades
    # The columns, the rows and the rows' cotangents are bf16, traded as their bits on
    # CPU (collectives.gathers_bits); the columns' gradient is summed in f32.
    kinds = sorted(c.dtype for c in found if c.kind == "all-to-all")
    assert kinds == ["f32", "u16", "u16", "u16"], kinds
    shard = vocab * emb // 8
    scatters = [c for c in found if c.kind == "reduce-scatter" and elements(c) == shard]
    assert len(scatters) == 1, scatters  # the output table's gradient only


@pytest.mark.slow  # ~12 s of compiles, cold
def test_buckets_gather_small_weights_together():
    # After SPMD partitioning (CPU HLO): one 16-bit all-gather per bucket, of the bucket's
    # bytes, and one for each parameter in none; the reduce-scatters stay per parameter.
    exp, layouts, low, found = _step_collectives("wus", "buckets")
    buckets = exp.plan.gather_buckets
    assert buckets and all(len(b) > 1 for b in buckets)
    bucketed = {i for b in buckets for i in b}
    sharded = [i for i, lay in enumerate(layouts) if lay.sharded]
    gathers = sorted(c.result_bytes for c in found if c.kind == "all-gather")
    want = [2 * sum(math.prod(layouts[i].stored_shape) for i in b) for b in buckets]
    want += [2 * math.prod(layouts[i].stored_shape) for i in sharded if i not in bucketed]
    assert gathers == sorted(want)
    assert len(gathers) < len(sharded)
    scatters = [c for c in found if c.kind == "reduce-scatter"]
    assert len(scatters) == len(sharded)


@pytest.mark.slow  # compiles four programs: ~35 s
def test_accumulation_keeps_one_gather_and_one_reduce_per_step():
    exp, layouts, low, found = _step_collectives("wus", accumulate=2)
    _check_weight_collectives(exp, layouts, low, found, gathers_per_step=1, depth=1)
    bytes_one = hlo.bytes_by_kind(_step_collectives("wus", accumulate=1)[3])
    assert hlo.bytes_by_kind(found) == bytes_one


@pytest.mark.slow  # ~12 s of compiles, cold
def test_fsdp_gathers_again_for_the_backward_pass():
    exp, layouts, low, found = _step_collectives("fsdp", accumulate=2)
    # Inside the micro-batch loop: gathered for the forward and again for the
    # backward pass, reduce-scattered once per micro-batch.
    _check_weight_collectives(exp, layouts, low, found, gathers_per_step=2, depth=2)


def test_none_step_all_reduces_f32_gradients():
    exp, layouts, _, found = _step_collectives("none")
    assert {c.kind for c in found} == {"all-reduce"}
    sizes = sorted(c.result_bytes for c in found if c.result_bytes > 8)
    assert sizes == sorted(4 * math.prod(lay.shape) for lay in layouts if math.prod(lay.shape) > 2)
    assert {c.dtype for c in found if c.result_bytes > 8} == {"f32"}


def test_state_stays_sharded_and_small():
    mesh = mesh_lib.make_mesh({"data": -1})
    plan = _plan(mesh)
    tx = ut.weight_update_sharding(optax.adam(1e-2), plan)
    with jax.set_mesh(mesh):
        stored = jax.jit(plan.to_stored, out_shardings=plan.stored_shardings())(_params())
        state = jax.jit(
            tx.init, out_shardings=plan.state_shardings(tx, jax.eval_shape(tx.init, stored))
        )(stored)
    sharded = [x for x in jax.tree.leaves((stored, state)) if not x.sharding.is_fully_replicated]
    per_device = sum(x.addressable_shards[0].data.nbytes for x in sharded)
    assert per_device * 8 == sum(x.nbytes for x in sharded)
    assert len(sharded) == 3 * sum(lay.sharded for lay in plan.layouts.values())
    assert isinstance(stored["mat"].sharding, NamedSharding)


@pytest.mark.parametrize("mode", ["wus", pytest.param("per_layer", marks=pytest.mark.slow)])
def test_each_device_draws_only_its_share_of_the_initial_values(mode):
    # A 2-layer Llama, its updates sharded in groups of 2 devices (as many as layers).
    # Flax's unbox constrains each initial value to its logical spec (replicated over
    # data), and the stored layout alone splits a stack by layer: either way every
    # device drew every tensor whole (a 64M model's init held 0.93 GiB a device).
    config = llama.get_config("synthetic")
    config.model.update(
        num_layers=2, emb_dim=256, num_heads=4, num_kv_heads=2, head_dim=64, mlp_dim=512,
        vocab_size=4096, max_len=32, tie_embeddings=False,
    )  # fmt: skip
    config.data.update(vocab_size=4096, max_length=32)
    config.global_batch_size = 8
    config.optimizer.update(update_sharding=mode, shard_group_size=2)
    exp = experiment.build(config, with_data=False)
    param_bytes = sum(x.size * 4 for x in jax.tree.leaves(exp.logical_state.params))
    temp = exp.lower_init().compile().memory_analysis().temp_size_in_bytes
    # Each device draws half (its group's share): under the whole model's f32 bytes
    # (11.5 MB of 13.1 MB here), where drawing it whole took 3.8 times them (50 MB).
    assert temp < param_bytes, (temp, param_bytes)
    # The same numbers as Flax's own initialisation of the model, on one device.
    with jax.set_mesh(exp.mesh):
        ours = jax.device_get(exp.params_to_logical(exp.init().params))
    task = exp.model.task
    plain = jax.device_get(
        jax.jit(lambda rng: nn.unbox(task.init_fn(rng, task.init_batch))["params"])(
            jax.random.split(jax.random.PRNGKey(config.seed))[0]
        )
    )
    jax.tree.map(np.testing.assert_array_equal, ours, plain)
