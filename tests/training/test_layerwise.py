"""The optimizer sees layers, not stacks: decay by role, trust ratios per layer.

The reference is optax itself on the *unstacked* tree (each stack ``[layers, ...]``
cut into one leaf per layer, as a model without ``scan_layers`` holds them), on one
device. Ours runs on the stacked tree, in its logical form and in the stored layouts
of ``wus`` (layers merged with the dims after them, padded, in rows of 128 lanes) and
``per_layer`` (each layer's slice sharded alike), on 8 devices.
"""

import importlib

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from configs import llama
from trainer.analysis import hlo
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import plan as plan_lib
from trainer.parallel import transform as transform_lib
from trainer.training import experiment, layerwise, optimizers

LAYERS = 3
# A stack of 3 layers beside unstacked parameters; over 8 shards under wus, "up" is
# merged with its layers dim in rows of 128 lanes, "query" merged and padded (3*5 = 15
# rows -> 16), the norm scale and bias merged whole.
SHAPES = {
    "layers/attention/query": (LAYERS, 5, 4, 8),
    "layers/attention/query_bias": (LAYERS, 4, 8),
    "layers/attention_norm/scale": (LAYERS, 16),
    "layers/mlp/up": (LAYERS, 4, 384),
    "token_embedding/embedding": (40, 16),
    "final_norm/scale": (16,),
    "head/bias": (40,),
}
STACKED = {name for name in SHAPES if name.startswith("layers/")}
LR, WEIGHT_DECAY, STEPS = 1e-2, 0.1, 3


def nested(flat):
    out = {}
    for name, value in flat.items():
        *parents, leaf = name.split("/")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def flat(tree):
    return {
        jax.tree_util.keystr(path, simple=True, separator="/"): x
        for path, x in jax.tree_util.tree_leaves_with_path(tree)
    }


def params():
    rng = np.random.default_rng(0)
    return {n: rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}


def grads(k):
    rng = np.random.default_rng(k + 1)
    # Layers of different scales, so that one trust ratio per stack would show.
    return {
        n: (rng.normal(size=s) * (np.arange(s[0]) + 1.0).reshape(-1, *[1] * (len(s) - 1))).astype(
            np.float32
        )
        if n in STACKED
        else rng.normal(size=s).astype(np.float32)
        for n, s in SHAPES.items()
    }


def unstacked(tree):
    """``layers/x`` of ``[L, ...]`` -> ``layers_0/x`` ... ``layers_{L-1}/x``."""
    out = {}
    for name, x in tree.items():
        if name in STACKED:
            top, rest = name.split("/", 1)
            out.update({f"{top}_{i}/{rest}": x[i] for i in range(LAYERS)})
        else:
            out[name] = x
    return out


def role_mask(tree):
    # The documented rule, written out: norm scales and biases are neither decayed
    # nor trust-ratioed.
    return {n: not (n.endswith("scale") or n.endswith("bias")) for n in tree}


REFERENCES = {
    # optax's own LAMB with its trust ratio masked like its decay (optax.lamb masks
    # only the decay; BERT's LAMB excludes norms and biases from both).
    "lamb": lambda mask: optax.chain(
        optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-6),
        optax.add_decayed_weights(WEIGHT_DECAY, mask=mask),
        optax.masked(optax.scale_by_trust_ratio(), mask),
        optax.scale_by_learning_rate(LR),
    ),
    "lars": lambda mask: optax.lars(
        LR,
        weight_decay=WEIGHT_DECAY,
        weight_decay_mask=mask,
        trust_ratio_mask=mask,
        trust_coefficient=0.001,
        momentum=0.9,
    ),
}
OURS = {
    "lamb": lambda views: layerwise.lamb(LR, views, eps=1e-6, weight_decay=WEIGHT_DECAY),
    "lars": lambda views: layerwise.lars(
        LR, views, weight_decay=WEIGHT_DECAY, trust_coefficient=0.001, momentum=0.9
    ),
}


def reference(name):
    p = unstacked(params())
    tx = REFERENCES[name](role_mask(p))
    state = tx.init(p)
    for k in range(STEPS):
        updates, state = tx.update(unstacked(grads(k)), state, p)
        p = optax.apply_updates(p, updates)
    return p


def stacks():
    return nested({n: ("layers" if n in STACKED else "") for n in SHAPES})


def ours(name, mode):
    """Ours on the stacked tree: ``mode`` "logical" on one device, else the stored
    layout of that update-sharding mode on 8 devices. Returns (logical params, plan)."""
    p = nested(params())
    if mode == "logical":
        views = layerwise.views(layerwise.logical_layouts(p), stacks())
        tx = OURS[name](views)
        state = tx.init(p)
        for k in range(STEPS):
            updates, state = tx.update(nested(grads(k)), state, p)
            p = optax.apply_updates(p, updates)
        return flat(p), None
    mesh = mesh_lib.make_mesh({"data": -1})
    plan = plan_lib.make_plan(
        p, jax.tree.map(lambda _: P(), p), mesh, mode=mode, min_shard_bytes=0, stacks=stacks()
    )
    tx = transform_lib.weight_update_sharding(
        OURS[name](layerwise.views(plan.layouts, plan.stacks)), plan
    )

    def run(p, gs):
        stored = plan.to_stored(p)
        state = tx.init(stored)
        for g in gs:
            updates, state = tx.update(plan.to_stored(g), state, stored)
            stored = optax.apply_updates(stored, updates)
        return plan.to_logical(stored)

    with jax.set_mesh(mesh):
        out = jax.jit(run)(p, [nested(grads(k)) for k in range(STEPS)])
    return flat(jax.device_get(out)), plan


@pytest.mark.parametrize("mode", ["logical", "wus", "per_layer"])
@pytest.mark.parametrize("name", ["lamb", "lars"])
def test_stacked_lamb_and_lars_equal_optax_on_the_unstacked_tree(name, mode):
    want = reference(name)
    got, plan = ours(name, mode)
    if mode == "wus":  # the layouts the module doc names are exercised
        lays = flat(plan.layouts)
        assert lays["layers/mlp/up"].lanes == 128 and lays["layers/mlp/up"].start == 0
        assert lays["layers/attention/query"].pad > 0 and lays["layers/attention/query"].start == 0
    if mode == "per_layer":  # each layer's slice sharded alike: the layers dim stays
        sharded = [n for n in STACKED if flat(plan.layouts)[n].sharded]
        assert len(sharded) >= 3 and all(flat(plan.layouts)[n].start >= 1 for n in sharded)
    before = unstacked(params())
    moved = 0.0
    for n, w in unstacked(got).items():
        np.testing.assert_allclose(w, want[n], rtol=1e-6, atol=1e-7, err_msg=f"{name} {mode} {n}")
        moved = max(moved, float(np.abs(want[n] - before[n]).max()))
    assert moved > 1e-3


def test_one_trust_ratio_per_stack_would_differ():
    # The check above can fail: LAMB on the stack as one tensor (what optax.lamb does
    # on a stacked tree) moves the layers by other amounts than the reference.
    want = reference("lamb")
    p = nested(params())
    views = layerwise.views(layerwise.logical_layouts(p))  # no stacks: whole tensors
    tx = OURS["lamb"](views)
    state = tx.init(p)
    for k in range(STEPS):
        updates, state = tx.update(nested(grads(k)), state, p)
        p = optax.apply_updates(p, updates)
    got = unstacked(flat(p))
    assert np.abs(got["layers_0/mlp/up"] - want["layers_0/mlp/up"]).max() > 1e-4


def test_without_norms_and_biases_ours_is_optax_lamb():
    # On a tree of weights only, the masks are all true: plain optax.lamb.
    weights = [n for n in SHAPES if role_mask(SHAPES)[n]]
    p0 = {n: params()[n] for n in weights}
    p = unstacked(p0)
    tx = optax.lamb(LR, eps=1e-6, weight_decay=WEIGHT_DECAY)
    state = tx.init(p)
    q = nested(p0)
    ours_tx = OURS["lamb"](
        layerwise.views(layerwise.logical_layouts(q), nested({n: n in STACKED for n in weights}))
    )
    ours_state = ours_tx.init(q)
    for k in range(STEPS):
        g = {n: grads(k)[n] for n in weights}
        updates, state = tx.update(unstacked(g), state, p)
        p = optax.apply_updates(p, updates)
        updates, ours_state = ours_tx.update(nested(g), ours_state, q)
        q = optax.apply_updates(q, updates)
    for n, w in unstacked(flat(q)).items():
        np.testing.assert_allclose(w, p[n], rtol=1e-6, atol=1e-7, err_msg=n)


def test_per_layer_norms_need_no_gather():
    # Under wus a layer's tensor is spread over the shards: its norm is the sum of the
    # shards' partial sums, one all-reduce of a [layers] vector; nothing is gathered.
    p = nested(params())
    mesh = mesh_lib.make_mesh({"data": -1})
    plan = plan_lib.make_plan(
        p, jax.tree.map(lambda _: P(), p), mesh, mode="wus", min_shard_bytes=0, stacks=stacks()
    )
    tx = transform_lib.weight_update_sharding(
        OURS["lamb"](layerwise.views(plan.layouts, plan.stacks)), plan
    )
    stored = jax.eval_shape(plan.to_stored, p)
    shardings = plan.stored_shardings()
    stored = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), stored, shardings
    )
    state = jax.eval_shape(tx.init, stored)
    with jax.set_mesh(mesh):
        text = jax.jit(tx.update).lower(stored, state, stored).compile().as_text()
    ops = hlo.collectives(text, 8)
    assert not [op for op in ops if op.kind == "all-gather"], ops
    reduced = [op for op in ops if op.kind == "all-reduce"]
    assert reduced, "the per-layer partial sums are summed over the shards"
    # Each all-reduce moves a few per-layer (or whole-tensor) sums, never a tensor.
    assert max(op.result_bytes for op in reduced) <= 4 * LAYERS * 2 * len(SHAPES), reduced


@pytest.mark.parametrize(
    "config_name",
    ["configs/llama.py:tiny", "configs/bert_large.py:tiny", "configs/transformer_1024.py:tiny"],
)
def test_roles_of_every_family(config_name):
    # The stacked norm scales ([layers, emb]) and q/k/v biases ([.., heads, head_dim])
    # are neither decayed nor trust-ratioed; every matrix and table is.
    path, variant = config_name.split(":")
    module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
    config = module.get_config(variant)
    model = experiment.build_model(config, with_data=False)
    views = layerwise.views(layerwise.logical_layouts(model.abstract_params), model.layer_stacks)
    flat_views = {v.name: v for v in jax.tree.leaves(views, is_leaf=layerwise._is_view)}
    stacked = [v for v in flat_views.values() if v.stacked]
    assert stacked, "the family's layers are a scanned stack"
    for name, view in flat_views.items():
        shape = model.abstract_params
        for part in name.split("/"):
            shape = shape[part]
        not_decayed = name.endswith("scale") or name.endswith("bias")
        assert view.decayed == (not not_decayed), (name, shape.shape)
    ranks = {len(view.layout.shape) for view in stacked if not view.decayed}
    assert ranks & {2, 3}, "rank is no proxy: stacked scales and biases have rank >= 2"


def test_the_start_line_counts_weights_per_layer_whatever_the_stacking():
    # The rule sees layers, so the line saying what it decays does too: a 3-layer
    # Llama's 7 matrices a layer and 2 tables are 23 weights, its 2 norms a layer and
    # the final norm 7 scales, stacked or not.
    lines = set()
    for scan in (True, False):
        config = llama.get_config("tiny,synthetic")
        config.model.update(num_layers=3, scan_layers=scan, tie_embeddings=False)
        exp = experiment.build(config, with_data=False)
        views = layerwise.views(exp.plan.layouts, exp.plan.stacks)
        lines.add(optimizers.describe(config.optimizer, views, config.num_train_steps))
    (line,) = lines
    assert "on 23 weights, not on 7 norm scales and biases" in line
