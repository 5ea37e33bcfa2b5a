"""Tests of models/transformer.py (and the decoding in models/decode.py), on tiny configs."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TINY_TRANSFORMER
from jax.sharding import PartitionSpec

from configs import transformer_1024
from models.decode import greedy_decode
from models.losses import cross_entropy_and_metrics
from models.transformer import (
    SIZES,
    Transformer,
    TransformerConfig,
    param_count,
    train_flops_per_example,
)

VOCAB = TINY_TRANSFORMER["vocab_size"]
PARAM_NAMES = {"vocab", "embed", "mlp", "heads", "kv"}


def tiny(**overrides) -> TransformerConfig:
    return TransformerConfig(**{**TINY_TRANSFORMER, "max_len": 32, **overrides})


def tokens(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), shape, 1, VOCAB)


# Shapes shared by most tests, so each jitted function compiles once.
INPUTS, TARGETS = (2, 10), (2, 8)

# Two packed examples per row. Segment 1: inputs 0-3, targets 0-2; segment 2: inputs 4-7,
# targets 3-6; the rest is padding (segment 0, token 0).
IN_SEG = jnp.array([[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]] * 2)
IN_POS = jnp.array([[0, 1, 2, 3, 0, 1, 2, 3, 0, 0]] * 2)
TG_SEG = jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]] * 2)
TG_POS = jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]] * 2)


def packed_batch(seed: int) -> dict[str, jax.Array]:
    return dict(
        inputs=jnp.where(IN_SEG > 0, tokens(seed, INPUTS), 0),
        targets=jnp.where(TG_SEG > 0, tokens(seed + 1, TARGETS), 0),
        inputs_positions=IN_POS,
        targets_positions=TG_POS,
        inputs_segmentation=IN_SEG,
        targets_segmentation=TG_SEG,
    )


def build(cfg: TransformerConfig):
    """(model, variables, jitted apply) for `cfg`."""
    model = Transformer(cfg)
    variables = jax.jit(model.init)(jax.random.PRNGKey(0), tokens(1, INPUTS), tokens(2, TARGETS))
    return model, variables, jax.jit(model.apply, static_argnames="train")


@pytest.fixture(scope="module")
def bf16_model():
    return build(tiny())  # the default: bf16 compute, f32 params


@pytest.fixture(scope="module")
def f32_model():
    """Float32 compute, so equality tests are not blurred by bf16 rounding."""
    return build(tiny(dtype=jnp.float32))


def count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))


def test_output_shape_and_dtype(bf16_model):
    model, variables, apply = bf16_model
    inputs = tokens(3, INPUTS).at[1, 6:].set(0)  # some padding
    for batch in (dict(inputs=inputs, targets=tokens(4, TARGETS)), packed_batch(5)):
        logits = apply(variables, **batch)
        assert logits.shape == (*TARGETS, VOCAB) and logits.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(logits)))
    encode = functools.partial(model.apply, method=Transformer.encode)
    encoded = jax.eval_shape(encode, variables, inputs)
    assert encoded.shape == (*INPUTS, 32) and encoded.dtype == jnp.bfloat16


@pytest.mark.parametrize("share", [True, False])
def test_param_count_matches_tree_and_all_params_are_named(share):
    cfg = tiny(share_embeddings=share)
    init = Transformer(cfg).init
    variables = jax.eval_shape(init, jax.random.PRNGKey(0), tokens(1, (1, 4)), tokens(2, (1, 3)))
    assert set(variables) == {"params"}
    # V*E = 2048 (x3 unshared); encoder layer: attention 4*32*32 = 4096, MLP 2*32*64 + 64 + 32
    # = 4192, 2 LN 128 -> 8416; decoder layer 2*4096 + 4192 + 192 = 12576; final LNs 128.
    assert param_count(cfg) == count(variables) == (23168 if share else 23168 + 2 * 2048)
    boxed = jax.tree.leaves(variables, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert all(isinstance(leaf, nn.Partitioned) for leaf in boxed)
    specs = jax.tree.leaves(
        nn.get_partition_spec(variables), is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    shapes = jax.tree.leaves(nn.unbox(variables))
    assert len(specs) == len(shapes) == len(boxed) == (35 if share else 37)
    for spec, leaf in zip(specs, shapes, strict=True):
        assert len(spec) == len(leaf.shape) and set(spec) <= PARAM_NAMES, (spec, leaf.shape)


def test_big_param_count():
    cfg = TransformerConfig(vocab_size=32000, **SIZES["big"])
    x = jnp.ones((1, 8), jnp.int32)
    shapes = jax.eval_shape(Transformer(cfg).init, jax.random.PRNGKey(0), x, x)
    # Shared embedding 32000 * 1024                                      =  32,768,000
    # Encoder layer: q/k/v/out 4 * 1024^2 = 4,194,304; MLP 2 * 1024 * 4096 + 4096 + 1024
    #   = 8,393,728; 2 LayerNorms 4,096 -> 12,592,128; x 6               =  75,552,768
    # Decoder layer: 2 attentions 8,388,608 + MLP 8,393,728 + 3 LayerNorms 6,144
    #   = 16,788,480; x 6                                                = 100,730,880
    # Final encoder and decoder LayerNorms                               =       4,096
    assert param_count(cfg) == count(shapes) == 209_055_744


def test_flops_formula():
    cfg = tiny()
    # S=10, T=8: encoder 10*(8*32*32 + 4*32*64) + 4*10^2*32 = 176,640; decoder 8*16,384
    # + 4*8^2*32 + 4*18*32*32 + 4*8*10*32 = 223,232; logits 2*8*32*64 = 32,768.
    assert train_flops_per_example(cfg, 10, 8) == 3 * (176_640 + 223_232 + 32_768)
    # XLA's count for the forward pass agrees up to the elementwise work the formula ignores
    # (no compilation: HLO cost analysis of the lowered f32 program, abstract params).
    cfg = tiny(
        vocab_size=512, emb_dim=128, num_heads=4, qkv_dim=128, mlp_dim=512, dtype=jnp.float32
    )
    model, x, y = Transformer(cfg), jnp.ones((1, 16), jnp.int32), jnp.ones((1, 12), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.PRNGKey(0), x, y)
    cost = jax.jit(model.apply).lower(variables, x, y).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert 1.0 < cost["flops"] / (train_flops_per_example(cfg, 16, 12) / 3) < 1.05


def test_runs_under_mesh_with_logical_rules(f32_model):
    # The trainer's rules: outside a mesh the logical annotations are no-ops, so only here
    # does a wrongly shaped or named annotation fail.
    model, variables, apply = f32_model
    rules = tuple(transformer_1024.get_config().mesh.rules)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    batch = packed_batch(70)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), **batch)
        specs = nn.logical_to_mesh_axes(shapes["params"]["shared_embedding"]["embedding"].names)
        assert specs == PartitionSpec("model", None)
        replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())
        logits = jax.jit(model.apply)(jax.device_put(variables, replicated), **batch)
    np.testing.assert_allclose(logits, apply(variables, **batch), atol=1e-5)


def test_packing_isolates_segments(f32_model):
    _, variables, apply = f32_model
    a = packed_batch(10)
    logits_a = apply(variables, **a)
    seg1, seg2 = TG_SEG == 1, TG_SEG == 2
    # Change every token of segment 2 (source and target): segment 1 is untouched.
    b = dict(
        a,
        inputs=jnp.where(IN_SEG == 2, tokens(20, INPUTS), a["inputs"]),
        targets=jnp.where(TG_SEG == 2, tokens(21, TARGETS), a["targets"]),
    )
    logits_b = apply(variables, **b)
    np.testing.assert_allclose(logits_a[seg1], logits_b[seg1], atol=1e-6)
    assert not np.allclose(logits_a[seg2], logits_b[seg2], atol=1e-3)
    # Change every token of segment 1, including its last target, which a segment-blind
    # shift would feed to segment 2's first position: segment 2 is untouched.
    c = dict(
        a,
        inputs=jnp.where(IN_SEG == 1, tokens(22, INPUTS), a["inputs"]),
        targets=jnp.where(TG_SEG == 1, tokens(23, TARGETS), a["targets"]),
    )
    logits_c = apply(variables, **c)
    np.testing.assert_allclose(logits_a[seg2], logits_c[seg2], atol=1e-6)
    assert not np.allclose(logits_a[seg1], logits_c[seg1], atol=1e-3)
    # Segment 2 packed gives the same logits as segment 2 alone, unpacked and padded.
    alone_inputs = jnp.zeros(INPUTS, int).at[:, :4].set(a["inputs"][:, 4:8])
    alone_targets = jnp.zeros(TARGETS, int).at[:, :4].set(a["targets"][:, 3:7])
    alone = apply(variables, alone_inputs, alone_targets)
    np.testing.assert_allclose(logits_a[:, 3:7], alone[:, :4], atol=1e-5)


def test_decoder_is_causal(f32_model):
    _, variables, apply = f32_model
    inputs, targets = tokens(30, INPUTS), tokens(31, TARGETS)
    logits = apply(variables, inputs, targets)
    t = 3
    changed = apply(variables, inputs, targets.at[:, t].set(targets[:, t] % 63 + 1))
    # Logits at position i see targets < i only (shifted right): t affects only i > t.
    np.testing.assert_allclose(logits[:, : t + 1], changed[:, : t + 1], atol=1e-6)
    assert not np.allclose(logits[:, t + 1], changed[:, t + 1], atol=1e-3)


def test_cached_decoding_matches_full_forward(f32_model):
    # Step-by-step decoding through the key/value cache, fed arbitrary tokens (teacher
    # forcing), reproduces the full forward pass at every position.
    model, variables, apply = f32_model
    inputs, targets = tokens(40, INPUTS).at[1, 5:].set(0), tokens(41, TARGETS)
    full = apply(variables, inputs, targets)
    stepper = model.clone(config=dataclasses.replace(model.config, decode=True))
    encoded = jax.jit(functools.partial(model.apply, method="encode"))(variables, inputs)

    def decode(cache, tokens, positions):
        return stepper.apply(
            {**variables, **cache},
            encoded,
            inputs,
            tokens,
            targets_positions=positions,
            mutable=["cache"],
            method="decode",
        )

    # The creation pass sees the full length and fixes the cache shapes; it starts zeroed.
    cache = jax.eval_shape(lambda t: decode({}, t, None)[1], targets)
    cache = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), cache)
    assert cache["cache"]["decoder_layers_0"]["self_attention"]["cached_key"].shape == (
        *TARGETS,
        2,
        16,
    )
    step, decoder_inputs = jax.jit(decode), jnp.pad(targets, ((0, 0), (1, 0)))
    for i in range(TARGETS[1]):
        logits, cache = step(cache, decoder_inputs[:, i : i + 1], jnp.full((2, 1), i))
        np.testing.assert_allclose(logits[:, 0], full[:, i], atol=1e-5, err_msg=f"step {i}")


def test_greedy_decode(f32_model):
    model, variables, apply = f32_model
    inputs = tokens(42, INPUTS).at[1, 5:].set(0)

    @jax.jit
    def decode(params, inputs, eos_id):
        return greedy_decode(model, params, inputs, max_decode_len=TARGETS[1], eos_id=eos_id)

    out = decode(variables["params"], inputs, -1)  # -1: never stops
    assert out.shape == TARGETS and out.dtype == jnp.int32
    # Fed its own output, the teacher-forced model predicts that same output (the padding
    # id 0 is never emitted).
    logits = apply(variables, inputs, out)
    np.testing.assert_array_equal(logits.at[..., 0].set(-jnp.inf).argmax(-1), out)

    # Stopping: with eos = a token from the middle of row 0, each row stops at its first
    # eos and is 0 afterwards.
    eos = int(out[0, 3])
    expected = np.array(out)
    for row in expected:
        hits = np.flatnonzero(row == eos)
        if hits.size:
            row[hits[0] + 1 :] = 0
    assert (expected == 0).any()
    np.testing.assert_array_equal(decode(variables["params"], inputs, eos), expected)


def test_dropout_only_in_train_mode(f32_model):
    _, variables, apply = f32_model
    inputs, targets = tokens(50, INPUTS), tokens(51, TARGETS)
    # rbg keys: threefry's dropout masks take seconds to compile on CPU.
    rng = {"dropout": jax.random.key(0, impl="rbg")}
    other = {"dropout": jax.random.key(1, impl="rbg")}
    ref = apply(variables, inputs, targets)
    np.testing.assert_array_equal(apply(variables, inputs, targets, rngs=rng), ref)
    train_a = apply(variables, inputs, targets, train=True, rngs=rng)
    np.testing.assert_array_equal(apply(variables, inputs, targets, train=True, rngs=rng), train_a)
    assert not np.allclose(train_a, ref, atol=1e-3)
    assert not np.allclose(train_a, apply(variables, inputs, targets, train=True, rngs=other))


@pytest.mark.slow  # 10-30 s of compiles, cold (the decoder's stacks: default suite)
def test_bfloat16_params(bf16_model):
    # The trainer may hand the model params already cast to bf16, also when differentiating.
    model, variables, apply = bf16_model
    inputs, targets = tokens(60, INPUTS), tokens(61, TARGETS)
    params = nn.unbox(variables["params"])
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)

    @jax.jit
    def grad(p):
        def loss(p):
            logits = model.apply({"params": p}, inputs, targets)
            return cross_entropy_and_metrics(logits, targets, label_smoothing=0.1)[0], logits

        return jax.grad(loss, has_aux=True)(p)

    grads, logits = grad(bf16)
    assert logits.dtype == jnp.float32
    # Only the rounding of the weights differs: compute is bf16 either way.
    np.testing.assert_allclose(logits, apply({"params": params}, inputs, targets), atol=0.1)
    grads = jax.tree.leaves(grads)
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert all(bool(jnp.any(g != 0)) for g in grads)


def test_cross_entropy_and_metrics():
    targets = jnp.array([[5, 2, 7, 0], [3, 3, 0, 0]])  # 5 real tokens
    weight = 5.0
    onehot = jax.nn.one_hot(targets, VOCAB)
    # Uniform prediction: nll = log V per token; the smoothed loss is log V - H(q).
    ls = 0.1
    low = ls / (VOCAB - 1)
    entropy = -(0.9 * math.log(0.9) + (VOCAB - 1) * low * math.log(low))
    loss, m = cross_entropy_and_metrics(jnp.zeros((2, 4, VOCAB)), targets, label_smoothing=ls)
    assert m["weight"] == weight
    np.testing.assert_allclose(m["nll"], weight * math.log(VOCAB), rtol=1e-6)
    np.testing.assert_allclose(loss, weight * (math.log(VOCAB) - entropy), rtol=1e-5)
    assert loss == m["loss"]
    # Predicting exactly the smoothed target costs nothing.
    smoothed = onehot * 0.9 + (1 - onehot) * low
    loss, m = cross_entropy_and_metrics(jnp.log(smoothed), targets, label_smoothing=ls)
    np.testing.assert_allclose(loss, 0.0, atol=1e-4)
    np.testing.assert_allclose(m["nll"], -weight * math.log(0.9), rtol=1e-5)
    assert m["accuracy"] == weight
    # Unsmoothed, explicit weights; one of the real tokens predicted wrong.
    logits = 50.0 * onehot.at[0, 1].set(jax.nn.one_hot(9, VOCAB))
    weights = jnp.array([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    loss, m = cross_entropy_and_metrics(logits, targets, weights, label_smoothing=0.0)
    assert m["weight"] == 3.0 and m["accuracy"] == 2.0
    np.testing.assert_allclose(loss, 50.0, rtol=1e-4)  # the one wrong token costs ~50 nats
    np.testing.assert_allclose(m["nll"], loss)


@pytest.fixture(scope="module")
def f32_layers():
    """Float32 compute, 2 encoder and 3 decoder layers (stacks worth the name)."""
    return build(tiny(dtype=jnp.float32, num_encoder_layers=2, num_decoder_layers=3))


@pytest.mark.slow  # 10-30 s of compiles, cold (the decoder's stacks: default suite)
@pytest.mark.parametrize("remat", ["none", "dots"])
def test_scanned_layers_compute_what_the_unscanned_ones_do(f32_layers, remat):
    from flax import traverse_util

    from models import stacking
    from models.decode import beam_decode

    model, variables, apply = f32_layers
    layers = {"num_encoder_layers": 2, "num_decoder_layers": 3}
    scanned = Transformer(tiny(dtype=jnp.float32, scan_layers=True, remat=remat, **layers))
    shapes = jax.eval_shape(scanned.init, jax.random.PRNGKey(0), **packed_batch(0))
    names = {
        v.names
        for v in jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, nn.Partitioned))
        if isinstance(v, nn.Partitioned) and v.value.ndim == 4
    }
    assert ("layers", "heads", "kv", "embed") in names  # stacked on a named leading axis
    # The unscanned parameters, stacked by the checkpoint converter.
    flat = traverse_util.flatten_dict(nn.unbox(variables["params"]), sep="/")
    wanted = traverse_util.flatten_dict(nn.unbox(shapes["params"]), sep="/")
    sources = stacking.match(wanted, flat)
    assert sorted(sources) == sorted(wanted)
    assert sources["encoder_layers/mlp/wi/kernel"].names == (
        "encoder_layers_0/mlp/wi/kernel",
        "encoder_layers_1/mlp/wi/kernel",
    )
    params = traverse_util.unflatten_dict(stacking.assemble(sources, flat), sep="/")
    batch = packed_batch(80)
    logits = jax.jit(scanned.apply)({"params": params}, **batch)
    np.testing.assert_allclose(logits, apply(variables, **batch), atol=2e-5)

    # Gradients: the stacked gradient is the per-layer gradients, stacked.
    def loss(model, p):
        return jnp.sum(jnp.square(model.apply({"params": p}, **batch)))

    g_scan = jax.jit(jax.grad(functools.partial(loss, scanned)))(params)
    g_layers = jax.jit(jax.grad(functools.partial(loss, model)))(nn.unbox(variables["params"]))
    g_layers = traverse_util.flatten_dict(g_layers, sep="/")
    for name, g in traverse_util.flatten_dict(g_scan, sep="/").items():
        want = stacking.assemble({name: sources[name]}, g_layers)[name]
        scale = float(np.abs(want).max())  # f32 sums in another order: relative to the tensor
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6 * scale, err_msg=name)
    # Decoding with the stacked key/value caches, greedy and beam search.
    inputs = tokens(81, INPUTS).at[1, 7:].set(0)
    greedy = functools.partial(greedy_decode, max_decode_len=6)
    np.testing.assert_array_equal(
        jax.jit(greedy, static_argnums=0)(scanned, params, inputs),
        jax.jit(greedy, static_argnums=0)(model, variables["params"], inputs),
    )
    beam = functools.partial(beam_decode, beam_size=3, max_decode_len=6, alpha=0.6)
    out_scan, scores_scan = jax.jit(beam, static_argnums=0)(scanned, params, inputs)
    out, scores = jax.jit(beam, static_argnums=0)(model, variables["params"], inputs)
    np.testing.assert_array_equal(out_scan, out)
    np.testing.assert_allclose(scores_scan, scores, rtol=1e-5)
