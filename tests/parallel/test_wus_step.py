"""The real train step under none / wus / fsdp against plain optax on unsharded weights.

The reference is independent of the update-sharding code: one device, no mesh,
the logical f32 params, each data replica's gradient taken with ``jax.vmap`` over
its rows and summed, and the same optax chain (global-norm clipping and warm-up
active) applied with ``optax.apply_updates``.

Tolerances. The sharded step differs from the reference only in the order the
f32 gradient sums are added (reduce-scatter vs one all-reduce): after 3 steps the
params agree to 2e-6 absolute (they move by ~3e-2); with bf16 compute the first
step's gradients agree to 1e-7. The reference must compile the model the same way
(same mesh, same logical constraints): with bf16 compute a different program
structure alone moves the rounding points, by up to 2e-2 relative on this tiny
model's gradients. Two precision tests look at exact properties instead: what
the model receives, and a gradient whose every term is exactly representable.
"""

import functools
import math
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tiny_wus as tiny
from jax.sharding import NamedSharding, PartitionSpec

from configs import llama, transformer_1024
from models import transformer
from trainer import tasks
from trainer.analysis import hlo
from trainer.input import feed as feed_lib
from trainer.parallel import batches as batches_lib
from trainer.parallel import collectives, precision
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import plan as us
from trainer.parallel import rules as rules_lib
from trainer.parallel import transform as ut
from trainer.training import experiment, layerwise, optimizers
from trainer.training import step as step_lib

STEPS = 3
ATOL_F32 = 2e-6


def callable_mask_adamw(config):
    schedule = optimizers.make_schedule(config.optimizer, config.num_train_steps)
    return optax.chain(
        optax.clip_by_global_norm(config.optimizer.clip_norm),
        optax.adamw(
            schedule, weight_decay=0.01, mask=lambda tree: jax.tree.map(lambda p: p.ndim > 1, tree)
        ),
    )


def logical_optimizer(config, exp, params):
    """The config's optimizer on the logical params (its stacks' layers one by one)."""
    views = layerwise.views(layerwise.logical_layouts(params), exp.plan.stacks)
    return optimizers.make_optimizer(config.optimizer, views, config.num_train_steps)[0]


def logical(exp, tree):
    with jax.set_mesh(exp.mesh):
        return jax.device_get(jax.jit(exp.plan.to_logical)(tree))


def run(config, optimizer=None, steps=STEPS):
    """Our train loop: (logical params before, final state, batches, experiment, metrics)."""
    exp = experiment.build(config, optimizer=optimizer)
    state = exp.init()
    before = logical(exp, state.params)
    feed = feed_lib.Feed(
        exp.task.train_data, functools.partial(batches_lib.to_global, exp.mesh, stacked=True)
    )
    stacked, _ = feed.next(steps)
    feed.close()
    state, metrics = experiment.compile_loop(exp, steps)(state, stacked)
    return before, state, jax.device_get(stacked), exp, jax.device_get(metrics)


def reference(exp, tx, params, batches, steps=STEPS, norms=None):
    """Plain data parallelism: optax on replicated f32 params, per-replica gradients
    (``jax.vmap`` over the replicas' rows, split over the data axes) summed by GSPMD.

    It runs on the experiment's mesh with the model's own logical sharding rules,
    so XLA compiles the model as in the trainer (with bf16 compute, where the
    rounding points fall depends on that), but none of the update-sharding code
    (plan, layouts, gather, reduce, optimizer wrapper) is involved. ``norms``, a
    list, receives each step's global gradient, update and parameter norms.
    """
    task, mesh = exp.task, exp.mesh
    data_axes = mesh_lib.data_axes(mesh)
    replicas = mesh_lib.data_parallel_size(mesh)

    def step(params, opt_state, batch):
        weight = task.weight_fn(batch)
        rows = jax.tree.map(lambda x: x.reshape(replicas, -1, *x.shape[1:]), batch)

        def loss(p, rows):
            return task.loss_fn({"params": p}, rows, jax.random.PRNGKey(0), True)[0] / weight

        grads = jax.vmap(jax.grad(loss), in_axes=(None, 0), spmd_axis_name=data_axes)(params, rows)
        grads = jax.tree.map(lambda g: g.sum(0), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        norm = {"grad_norm": grads, "update_norm": updates, "param_norm": params}
        return params, opt_state, {k: optax.tree.norm(v) for k, v in norm.items()}

    replicated = NamedSharding(mesh, PartitionSpec())
    split = NamedSharding(mesh, PartitionSpec(data_axes))
    rules = rules_lib.without_data_axes(exp.model.rules, mesh)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        params = jax.device_put(params, replicated)
        opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
        step = jax.jit(step, out_shardings=replicated)
        for k in range(steps):
            batch = jax.device_put(jax.tree.map(lambda x, k=k: x[k], batches), split)
            params, opt_state, step_norms = step(params, opt_state, batch)
            if norms is not None:
                norms.append(jax.device_get(step_norms))
    return jax.device_get(params)


def assert_close(got, want, atol, what):
    for path, a in jax.tree_util.tree_leaves_with_path(got):
        b = want
        for key in path:
            b = b[key.key]
        np.testing.assert_allclose(a, b, atol=atol, rtol=0, err_msg=f"{what}: {path}")


@functools.cache
def run_case(mesh, mode, opt, accumulate=1):
    """``run`` of a named case, shared by the tests below."""
    config = tiny(
        mode, "adamw" if opt == "adamw_callable" else opt, mesh=mesh, accumulate=accumulate
    )
    custom = callable_mask_adamw(config) if opt == "adamw_callable" else None
    return (config, custom, *run(config, custom))


@functools.cache
def reference_case(opt, model="data8"):
    """The reference of an optimizer: the same for every mesh (the per-replica
    gradients of 8 or 4 replicas sum to the same whole-batch gradient); the scanned
    2+2-layer model has its own."""
    config, custom, before, _, batches, exp, _ = run_case(model, "wus", opt)
    tx = custom or logical_optimizer(config, exp, before)
    return reference(exp, tx, before, batches)


CASES = [
    *[("data8", "wus", opt) for opt in ("adam", "adamw", "adamw_callable", "lamb", "lars", "sgd")],
    ("data8", "none", "adam"),
    ("data8", "fsdp", "adam"),
    ("data8", "fsdp", "lamb"),
    *[("data4_model2", mode, "adamw_callable") for mode in ("none", "wus", "fsdp")],
    ("group2", "wus", "lars"),
    ("buckets", "wus", "adam"),
    ("buckets", "fsdp", "adam"),
    ("scanned", "wus", "adam"),
    ("scanned", "fsdp", "adam"),
]


# The cases the slow suite adds (each 10-40 s of compiles, cold): the default suite
# keeps Adam and LAMB under wus on data-parallel devices. Layer stacks stay in it
# through the bf16 test below (the stacked step's gradients against plain data
# parallelism) and tests/training/test_layerwise.py (the stacked optimizers against
# optax on the unstacked tree).
SLOW_CASES = {
    ("scanned", "wus", "adam"),
    ("group2", "wus", "lars"),
    ("data8", "none", "adam"),
    ("data4_model2", "wus", "adamw_callable"),
    ("data8", "wus", "lars"),
    ("data8", "fsdp", "adam"),
    ("buckets", "wus", "adam"),
    ("data8", "wus", "adamw"),
    ("data8", "wus", "adamw_callable"),
    ("data8", "wus", "sgd"),
    ("data8", "fsdp", "lamb"),
    ("data4_model2", "none", "adamw_callable"),
    ("data4_model2", "fsdp", "adamw_callable"),
    ("buckets", "fsdp", "adam"),
    ("scanned", "fsdp", "adam"),
}


@pytest.mark.parametrize(
    "mesh, mode, opt",
    [pytest.param(*c, marks=[pytest.mark.slow] if c in SLOW_CASES else []) for c in CASES],
)
def test_train_step_matches_plain_optax(mesh, mode, opt):
    _, _, before, state, _, exp, _ = run_case(mesh, mode, opt)
    want = reference_case(opt, "scanned" if mesh == "scanned" else "data8")
    if mesh == "buckets":
        assert len(exp.plan.gather_buckets) >= 1  # the shared all-gathers are exercised
    assert_close(logical(exp, state.params), want, ATOL_F32, f"{opt} {mode} on {mesh}")
    moved = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), want, before)
    assert max(jax.tree.leaves(moved)) > 200 * ATOL_F32  # the params did move


@pytest.mark.slow  # 10-40 s of compiles, cold
def test_logged_norms_match_plain_optax():
    # On 6 devices several stored tensors carry padding; the norms the step reports
    # (computed on the shards) must be those of the real tensors.
    config, _, before, _, batches, exp, metrics = run_case("devices6", "wus", "lamb")
    assert any(lay.pad for lay in jax.tree.leaves(exp.plan.layouts, is_leaf=us.is_layout))
    tx = logical_optimizer(config, exp, before)
    norms = []
    reference(exp, tx, before, batches, norms=norms)
    for key in ("grad_norm", "update_norm", "param_norm"):
        want = [n[key] for n in norms]
        np.testing.assert_allclose(metrics[key], want, rtol=2e-6, err_msg=key)
    assert metrics["grad_norm"][0] > 0.5  # clip_norm=0.5 is active: norms are pre-clipping


@pytest.mark.slow  # 10-40 s of compiles, cold
@pytest.mark.parametrize("mode", ["wus", "fsdp"])
def test_accumulation_matches_one_big_batch(mode):
    *_, one, _, exp, metrics_one = run_case("data8", mode, "adam")
    *_, two, _, exp2, metrics_two = run_case("data8", mode, "adam", accumulate=2)
    np.testing.assert_allclose(metrics_two["loss"], metrics_one["loss"], rtol=1e-6)
    assert_close(logical(exp2, two.params), logical(exp, one.params), ATOL_F32, "A=2 vs A=1")
    assert_close(logical(exp2, two.params), reference_case("adam"), ATOL_F32, "A=2 vs reference")


@pytest.mark.slow  # ~19 s of compiles, cold
def test_padding_stays_zero():
    *_, state, _, exp, _ = run_case("devices6", "wus", "lamb")
    layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "stored_shape"))
    padded = 0
    for lay, param in zip(layouts, jax.tree.leaves(state.params), strict=True):
        if lay.sharded and lay.pad:
            padded += 1
            size = param.shape[lay.dim]
            tail = np.asarray(param).take(range(size - lay.pad, size), axis=lay.dim)
            assert np.all(tail == 0), lay
    assert padded >= 3  # 6 shards: several tensors need padding


@pytest.mark.slow  # 10-40 s of compiles, cold
def test_bf16_compute_gradients_match_reference():
    config = tiny("wus", "sgd", dtype="bfloat16")
    config.optimizer.update(clip_norm=0.0, warmup_steps=0, learning_rate=1.0)
    before, state, batches, exp, _ = run(config, steps=1)
    got = jax.tree.map(np.subtract, before, logical(exp, state.params))  # SGD, lr 1: the grads
    want = jax.tree.map(np.subtract, reference(exp, optax.identity(), before, batches, 1), before)
    # The gather rounds only what the model rounds anyway, so even with bf16
    # compute the gradients are those of the replicated f32 weights.
    assert_close(got, want, 1e-7, "bf16 compute, grads")
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(want)) > 1e-2


@pytest.mark.slow  # 10-40 s of compiles, cold
def test_layernorm_reaches_model_exactly_and_kernels_travel_in_bf16():
    config = transformer_1024.get_config("tiny,synthetic")
    config.optimizer.min_shard_bytes = 0
    exp = experiment.build(config)
    flags = {
        jax.tree_util.keystr(p, simple=True, separator="/"): f
        for p, f in jax.tree_util.tree_leaves_with_path(exp.plan.low_precision)
    }
    assert all(not f for name, f in flags.items() if name.endswith("scale")), flags
    assert all(f for name, f in flags.items() if name.endswith("kernel")), flags
    assert flags["shared_embedding/embedding"]  # looked up in f32, rounded after the lookup
    # Trained-looking weights: scales off 1.0, so a bf16 rounding would show.
    params = logical(exp, exp.init().params)
    noise = iter(np.random.default_rng(0).normal(size=len(jax.tree.leaves(params))))
    params = jax.tree.map(
        lambda p: (p + 1e-3 * next(noise) * (1 + np.arange(p.size).reshape(p.shape) % 7)).astype(
            np.float32
        ),
        params,
    )
    with jax.set_mesh(exp.mesh):
        stored = jax.jit(exp.plan.to_stored, out_shardings=exp.plan.stored_shardings())(params)
        seen = jax.device_get(jax.jit(exp.plan.gather)(stored))
    rounded_scales = 0
    for path, values in jax.tree_util.tree_leaves_with_path(seen):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        want = params
        for key in path:
            want = want[key.key]
        want = np.asarray(want)
        as_bf16 = want.astype(jnp.bfloat16).astype(np.float32)
        if name.endswith("scale"):
            rounded_scales += int(np.sum(as_bf16 != want))
        for replica in values:  # every replica's copy, bit for bit
            np.testing.assert_array_equal(replica, as_bf16 if flags[name] else want, name)
    assert rounded_scales > 100  # bf16 would have changed them


class _Table(nn.Module):
    table: transformer.Embedding

    def __call__(self, ids):
        return self.table(ids)


def test_repeated_token_embedding_gradient_accumulates_in_f32():
    """One token 3,000 times in each replica's rows: its gradient row is a sum of
    3,000 equal, exactly representable terms; in bf16 it would stall at 256."""
    config = tiny("wus", "sgd", dtype="bfloat16")
    exp = experiment.build(config)
    emb = transformer.Embedding(64, 32, dtype=jnp.bfloat16, param_dtype=jnp.float32)
    weights = jnp.linspace(-1, 1, 32, dtype=jnp.float32).astype(jnp.bfloat16)

    def loss_fn(variables, batch, rng, train, layer_weights=()):
        del rng, train, layer_weights
        out = emb.apply(variables, batch["ids"]).astype(jnp.float32) * weights
        return jnp.sum(out), ({"weight": jnp.ones(())}, {})

    rows, replicas = 3000, 8
    ids = np.full((replicas * rows,), 7, np.int32)
    task = tasks.Task(
        model=emb,
        eval_model=emb,
        init_batch={"ids": ids[:1]},
        train_data=iter(()),
        eval_batches=lambda: (),
        loss_fn=loss_fn,
        weight_fn=lambda b: jnp.ones(()),
        init_fn=lambda r, b: emb.init(r, b["ids"]),
    )
    params = {"embedding": jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)}
    plan = us.make_plan(
        params,
        {"embedding": jax.sharding.PartitionSpec()},
        exp.mesh,
        min_shard_bytes=0,
        low_precision={"embedding": True},
    )
    capture = optax.GradientTransformation(
        lambda p: {"g": jax.tree.map(jnp.zeros_like, p)},
        lambda g, s, p=None: (jax.tree.map(jnp.zeros_like, g), {"g": g}),
    )
    tx = ut.weight_update_sharding(capture, plan)
    with jax.set_mesh(exp.mesh):
        stored = jax.jit(plan.to_stored, out_shardings=plan.stored_shardings())(params)
        state = step_lib.TrainState(
            jnp.zeros((), jnp.int32), stored, tx.init(stored), {}, jax.random.PRNGKey(0)
        )
        shardings = jax.tree.map(lambda x: x.sharding, state)
        fns = step_lib.make_step_fns(task, plan, tx, lambda s: 0.0, exp.model.rules, shardings)
        batch = batches_lib.to_global(exp.mesh, {"ids": ids})
        new, _ = jax.jit(fns.train_step)(state, batch)
        grad = jax.device_get(jax.jit(plan.to_logical)(new.opt_state.inner_state["g"]))
    want = replicas * rows * np.asarray(weights, np.float64)
    got = np.asarray(grad["embedding"][7], np.float64)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    assert not np.any(np.delete(np.asarray(grad["embedding"]), 7, axis=0))


def test_six_shards_pad_ten_rows_to_twelve():
    lay = us.make_plan(
        {"w": jnp.zeros((10, 4))},
        {"w": jax.sharding.PartitionSpec()},
        mesh_lib.make_mesh({"data": -1}, devices=jax.devices()[:6]),
        min_shard_bytes=0,
    ).layouts["w"]
    assert lay.stored_shape == (12, 4) and lay.pad == 2
    assert math.isclose(lay.padding, 0.2)


@pytest.mark.slow  # 10-40 s of compiles, cold
@pytest.mark.parametrize("mode", ["none", "wus", "fsdp"])
def test_bf16_master_weights_train_in_every_mode(mode):
    config = tiny(mode, "adam", dtype="bfloat16")
    config.model.param_dtype = "bfloat16"
    config.optimizer.state_dtype = "float32"
    _, state, _, exp, metrics = run(config, steps=4)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {np.dtype(jnp.bfloat16)}
    moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim]
    assert moments and {x.dtype for x in moments} == {np.dtype(np.float32)}
    losses = metrics["loss"] / metrics["weight"]
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


@pytest.mark.slow  # 10-40 s of compiles, cold
def test_remat_recomputes_the_same_step():
    # The memory it saves is asserted on the TPU compiler (tests/test_aot.py):
    # XLA:CPU's buffer assignment keeps the same temporaries either way.
    runs = {}
    for remat in ("none", "full", "dots"):
        config = tiny("wus", "adam")
        config.model.remat = remat
        _, state, _, exp, metrics = run(config, steps=2)
        runs[remat] = (logical(exp, state.params), metrics)
    for remat in ("full", "dots"):
        np.testing.assert_allclose(runs[remat][1]["loss"], runs["none"][1]["loss"], rtol=1e-6)
        assert_close(runs[remat][0], runs["none"][0], 1e-6, f"remat={remat}")


@pytest.mark.parametrize(
    "model, mode",
    [
        ("scanned", "wus"),
        ("data8", "wus"),
        # per_layer's numbers stay in the default suite through
        # tests/tasks/test_language_model.py (its losses against wus's, 1.5e-7).
        pytest.param("scanned", "per_layer", marks=pytest.mark.slow),
        pytest.param("scanned", "fsdp", marks=pytest.mark.slow),
    ],
)
def test_rounded_weights_reach_the_model_in_bf16_with_the_gradients_of_f32_weights(
    model, mode, monkeypatch
):
    # The 2+2-layer Transformer with bf16 compute: the kernels the model rounds once are
    # handed to it in bf16, a stack's to the layers' scan whole (not cast back to f32,
    # which would make the scan's operand a float32 copy of the stack), and the
    # gradients are still those of plain data parallelism on f32 weights.
    config = tiny(mode, "sgd", mesh=model, dtype="bfloat16")
    config.optimizer.update(clip_norm=0.0, warmup_steps=0, learning_rate=1.0, weight_decay=0.0)
    before, state, batches, exp, _ = run(config, steps=1)
    names = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_leaves_with_path(before)]
    handed = {n for n, h in zip(names, exp.plan.handed_low, strict=True) if h}
    # Every sharded kernel and bias of attention and the MLPs; not the norms (used in
    # f32), nor the token table shared by the input and the output (looked up, and used
    # twice). (Replicated weights are not gathered: passed on as stored.)
    sharded = [lay.sharded for lay in jax.tree.leaves(exp.plan.layouts, is_leaf=us.is_layout)]
    assert handed == {
        n
        for n, shard in zip(names, sharded, strict=True)
        if shard and "norm" not in n and "embedding" not in n
    }
    if mode == "wus":
        with jax.set_mesh(exp.mesh):
            weights = jax.eval_shape(exp.plan.gather, state.params)
        dtypes = {n: w.dtype.name for n, w in zip(names, jax.tree.leaves(weights), strict=True)}
        assert dtypes == {n: "bfloat16" if n in handed else "float32" for n in names}
    got = jax.tree.map(np.subtract, before, logical(exp, state.params))  # SGD, lr 1: the grads
    if mode == "per_layer":
        # Its shard_map program rounds the activations where GSPMD's does not (1e-4
        # apart in bf16 with or without this): against the same run with every weight
        # cast back to f32, bit for bit.
        precision_of = precision.params_precision
        monkeypatch.setattr(
            precision,
            "params_precision",
            lambda *a, **k: precision_of(*a, **k)._replace(
                kept=jax.tree.map(lambda _: False, before)
            ),
        )
        before_f32, state_f32, _, exp_f32, _ = run(config, steps=1)
        assert not any(exp_f32.plan.handed_low)
        want = jax.tree.map(np.subtract, before_f32, logical(exp, state_f32.params))
        jax.tree.map(np.testing.assert_array_equal, got, want)
    else:
        want = jax.tree.map(
            np.subtract, reference(exp, optax.identity(), before, batches, 1), before
        )
        assert_close(got, want, 1e-7, f"bf16 compute, {mode}, grads")
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(want)) > 1e-2


def _per_layer_sgd_decoder(**optimizer):
    """The tiny decoder in f32 under ``per_layer``, trained by SGD at learning rate 1
    with nothing else (no clipping, warm-up or decay): a step moves each weight by its
    gradient."""
    config = llama.get_config("tiny,synthetic")
    config.model.update(dtype="float32")
    config.optimizer.update(
        name="sgd",
        update_sharding="per_layer",
        clip_norm=0.0,
        warmup_steps=0,
        learning_rate=1.0,
        weight_decay=0.0,
        schedule="constant",
        **optimizer,
    )
    return config


def _one_sgd_step_is_data_parallelisms(config, what: str, floor: float):
    """One step of ``config`` (SGD at learning rate 1, nothing else): asserts its
    gradients equal plain data parallelism's (:func:`reference`) to 2e-7, the largest
    above ``floor``; returns the experiment."""
    before, state, batches, exp, _ = run(config, steps=1)
    got = jax.tree.map(np.subtract, before, logical(exp, state.params))
    want = jax.tree.map(np.subtract, reference(exp, optax.identity(), before, batches, 1), before)
    assert_close(got, want, 2e-7, what)
    assert max(float(np.abs(g).max()) for g in jax.tree.leaves(want)) > floor
    return exp


@pytest.mark.slow  # 30 s of compiles, cold
def test_per_layer_with_a_model_axis_left_to_the_compiler():
    # data4 x model2: per_layer's shard_map is manual over data only, and the model's
    # sharding constraints on the model axis stay in force inside its vmap over the
    # replica. One SGD step's gradients against plain data parallelism in f32.
    config = tiny("per_layer", "sgd", mesh="data4_model2")
    config.model.update(num_encoder_layers=2, num_decoder_layers=2, scan_layers=True)
    config.optimizer.update(clip_norm=0.0, warmup_steps=0, learning_rate=1.0, weight_decay=0.0)
    exp = _one_sgd_step_is_data_parallelisms(config, "per_layer, data4_model2, grads", 1e-2)
    assert dict(exp.mesh.shape) == {"replica": 1, "data": 4, "model": 2}


def test_per_layer_under_tensor_parallelism_gathers_each_model_shard_by_itself():
    # data4 x model2, the tiny decoder: per_layer's shard_map is manual over data alone,
    # and its gathers and reduce-scatters run on each model shard by itself. Were the
    # model axis left to the partitioner there, it would gather every model-split weight
    # over the model axis before the gather over data, and each gradient in f32 before
    # its reduce-scatter (pairs of devices here; v5e-128b did not fit). The MLP's
    # output kernel and the tied table store data joined with model on one dim, which the
    # shard_map must see taken apart. One SGD step's gradients against plain data
    # parallelism.
    config = _per_layer_sgd_decoder()
    config.mesh.axes.update(data=4, model=2)
    exp = _one_sgd_step_is_data_parallelisms(config, "per_layer, data4 x model2, grads", 5e-3)
    joined = {
        rules_lib.param_name(path): lay.stored_spec()
        for path, lay in jax.tree_util.tree_leaves_with_path(exp.plan.layouts, is_leaf=us.is_layout)
        if lay.sharded and lay.spec[lay.dim]
    }
    assert joined == {
        "layers/mlp/down": PartitionSpec(None, ("model", "data"), None),
        "token_embedding/embedding": PartitionSpec(("model", "data"), None),
    }
    found = hlo.collectives(experiment.compile_loop(exp, 1).as_text(), 8)
    moved = [(c.kind, c.group_size) for c in found if c.kind in ("all-gather", "reduce-scatter")]
    assert {kind for kind, _ in moved} == {"all-gather", "reduce-scatter"}
    assert {size for _, size in moved} == {4}  # over data only


@pytest.mark.parametrize(
    "tied, model",
    [
        (True, 1),
        # The untied input table stays sharded and is looked up (its own sum over the
        # replicas); with a model axis, the gathers run per model shard.
        pytest.param(False, 1, marks=pytest.mark.slow),
        pytest.param(True, 2, marks=pytest.mark.slow),
    ],
)
def test_per_layer_sums_each_gradient_over_the_replicas_once(tied, model):
    # Update-sharding groups of 2 devices (mesh.replica > 1, as on several slices): each
    # gradient is reduce-scattered within the group and all-reduced over the replicas.
    # The replicas' shard_map also summed every sharded leaf's gradient over ``replica``
    # in its transpose: R times the gradient (4x here), and on two v5p slices an f32
    # all-reduce of every shard across the DCN. One SGD step against plain data
    # parallelism.
    config = _per_layer_sgd_decoder(shard_group_size=2)
    config.model.tie_embeddings = tied
    config.mesh.axes.update(data=-1, model=model)
    what = f"per_layer, groups of 2, model {model}, tied {tied}"
    exp = _one_sgd_step_is_data_parallelisms(config, what, 5e-3)
    assert dict(exp.mesh.shape) == {"replica": 4 // model, "data": 2, "model": model}
    if not tied:
        table = exp.plan.layouts["token_embedding"]["embedding"]
        assert exp.task.lookup_tables == ("token_embedding",)
        assert collectives.lookup_eligible(table, exp.mesh.shape["data"])


def _unfused_dots(hlo_text: str) -> list[str]:
    """The dots of an optimized XLA:CPU program that no YNNPACK fusion runs."""
    parsed = {
        name: [(line, hlo.instruction(line)) for line in body]
        for name, body in hlo.computations(hlo_text).items()
    }
    in_library = {
        re.search(r"calls=%?([\w.\-]+)", i.rest).group(1)
        for body in parsed.values()
        for _, i in body
        if i and i.opcode == "fusion" and '"__ynn_fusion"' in i.rest
    }
    return [
        line.strip()[:120]
        for name, body in parsed.items()
        if name not in in_library
        for line, i in body
        if i and i.opcode == "dot"
    ]


def test_per_layer_weight_gradients_run_in_the_cpu_matmul_library():
    # XLA:CPU hands a dot to YNNPACK only in canonical form (lhs [m, k], rhs [k, n]).
    # A weight's gradient contracts both operands over their tokens; without a batch
    # dim XLA leaves that dot as it is, to Eigen's bf16 GEMM, which took half of
    # per_layer's step on the harness's 2M decoder. With one (the replica's vmap in
    # trainer/parallel/layer_gather.py, as under wus) it transposes the operands first.
    config = llama.get_config("tiny,synthetic")
    config.model.update(dtype="bfloat16", num_layers=2)
    config.optimizer.update_sharding = "per_layer"
    exp = experiment.build(config)
    hlo = experiment.compile_loop(exp, 1).as_text()
    assert hlo.count('"__ynn_fusion"') >= 3 * 2  # at least the MLP's three, a layer
    assert _unfused_dots(hlo) == []
