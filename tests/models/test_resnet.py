"""Tests of models/resnet.py: real computation only on the tiny config at 32x32."""

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from jax.extend.core import subjaxprs
from jax.sharding import PartitionSpec

from models.resnet import SIZES, ResNet, ResNetConfig, param_count, train_flops_per_example

CLASSES, SIZE = 10, 32
CONV_NAMES = ("conv_h", "conv_w", "channels_in", "channels")


def tiny(**overrides) -> ResNetConfig:
    return ResNetConfig(**{**SIZES["tiny"], "num_classes": CLASSES, **overrides})


def images(seed: int, batch: int, size: int = SIZE) -> jax.Array:
    return jnp.asarray(
        np.random.default_rng(seed).standard_normal((batch, size, size, 3)), jnp.float32
    )


def count(tree) -> int:
    return sum(math.prod(x.shape) for x in jax.tree.leaves(nn.unbox(tree)))


def abstract_variables(cfg: ResNetConfig, size: int = 224):
    x = jax.ShapeDtypeStruct((1, size, size, 3), jnp.float32)
    return jax.eval_shape(lambda x: ResNet(cfg).init(jax.random.PRNGKey(0), x, train=False), x)


@functools.cache
def appliers(cfg: ResNetConfig):
    """Jitted (train, eval) applications of ResNet(cfg), each compiled once per config."""
    model = ResNet(cfg)
    train = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
    return train, jax.jit(lambda v, x: model.apply(v, x, train=False))


def random_params(params, seed: int):
    """Params drawn with numpy (no compilation): He-scaled kernels, BN scales 1 + noise and
    biases noise, so no residual branch is switched off by its zero-initialised scale."""
    rng = np.random.default_rng(seed)

    def draw(path, p):
        noise = rng.standard_normal(p.shape).astype(np.float32)
        name = path[-1].key
        if name == "kernel":
            return jnp.asarray(noise * math.sqrt(2.0 / math.prod(p.shape[:-1])))
        return jnp.asarray(float(name == "scale") + (0.1 if name == "head_kernel" else 0.3) * noise)

    return jax.tree_util.tree_map_with_path(draw, params)


@pytest.fixture(scope="module")
def init_variables():
    """Tiny variables from `init` (rbg key: threefry's init compiles for seconds on CPU)."""
    init = jax.jit(lambda k, x: ResNet(tiny()).init(k, x, train=False))
    return nn.unbox(init(jax.random.key(0, impl="rbg"), images(0, 2)))


@pytest.fixture(scope="module")
def f32_tiny(init_variables):
    """Float32 compute, so equality tests are not blurred by bf16 rounding; random params,
    running averages after one train step."""
    cfg = tiny(dtype=jnp.float32)
    variables = {**init_variables, "params": random_params(init_variables["params"], 1)}
    _, state = appliers(cfg)[0](variables, images(1, 8))
    return cfg, {**variables, **state}


def test_resnet50_param_count():
    cfg = ResNetConfig(**SIZES["resnet50"])
    variables = abstract_variables(cfg)
    # Stem 7*7*3*64 + BN 128                                                 =      9,536
    # Stage 1 (256 out): block 1 with projection 75,008; blocks 2-3 70,400 each =    215,808
    # Stage 2 (512 out): block 1 379,392; blocks 2-4 280,064 each            =  1,219,584
    # Stage 3 (1024 out): block 1 1,512,448; blocks 2-6 1,117,184 each       =  7,098,368
    # Stage 4 (2048 out): block 1 6,039,552; blocks 2-3 4,462,592 each       = 14,964,736
    # Head 2048 * 1000 + 1000                                                =  2,049,000
    # (block with in c, mid m, out 4m: c*m + 9m^2 + 4m^2 + BN 12m [+ c*4m + 8m projection])
    assert param_count(cfg) == count(variables["params"]) == 25_557_032
    # Not trainable: running mean and variance per BN channel (53 BNs, 26,560 channels).
    assert count(variables["batch_stats"]) == 2 * 26_560
    assert param_count(ResNetConfig(**SIZES["resnet18"])) == 11_689_512
    # Tiny: stem 1,176 + 16; block 1 2 * (576 + 16); block 2 1,184 + 2,336 + projection 160;
    # head 16 * 10 + 10.
    assert param_count(tiny()) == count(abstract_variables(tiny(), SIZE)["params"]) == 6_226


def test_output_shapes_dtypes_and_init(init_variables):
    train, evaluate = appliers(tiny())  # bf16 compute
    x = images(2, 4).astype(jnp.float16)  # any float input dtype
    for logits in (evaluate(init_variables, x), train(init_variables, x)[0]):
        assert logits.shape == (4, CLASSES) and logits.dtype == jnp.float32
        assert bool(jnp.all(jnp.isfinite(logits)))
    params, stats = init_variables["params"], init_variables["batch_stats"]
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    # The last BN of each residual branch starts at scale 0, every other BN at 1.
    for block in ("stage1_block1", "stage2_block1"):
        assert not np.any(params[block]["bn2"]["scale"])
        assert np.all(params[block]["bn1"]["scale"] == 1)
    assert np.all(params["stage2_block1"]["proj_bn"]["scale"] == 1)
    assert np.all(stats["stem_bn"]["mean"] == 0) and np.all(stats["stem_bn"]["var"] == 1)
    # ResNet-18 at 224 and at a non-square 160x128, abstractly.
    cfg18 = ResNetConfig(**SIZES["resnet18"])
    variables = abstract_variables(cfg18)
    for shape in ((2, 224, 224, 3), (3, 160, 128, 3)):
        out = jax.eval_shape(
            lambda v, x: ResNet(cfg18).apply(v, x, train=False),
            variables,
            jax.ShapeDtypeStruct(shape, jnp.bfloat16),
        )
        assert out.shape == (shape[0], 1000) and out.dtype == jnp.float32


def test_v1_5_downsamples_in_the_3x3_conv():
    cfg = ResNetConfig(**SIZES["resnet50"])
    variables = abstract_variables(cfg)
    block = variables["params"]["stage2_block1"]
    shapes = {k: v["kernel"].value.shape for k, v in block.items() if "conv" in k}
    assert shapes == {
        "conv1": (1, 1, 256, 128),
        "conv2": (3, 3, 128, 128),
        "conv3": (1, 1, 128, 512),
        "proj_conv": (1, 1, 256, 512),
    }
    assert "proj_conv" not in variables["params"]["stage2_block2"]
    # Spatial sizes of the intermediate outputs: the 1x1 keeps 56x56, the 3x3 halves it.
    _, inter = jax.eval_shape(
        lambda v, x: ResNet(cfg).apply(
            v, x, train=False, capture_intermediates=True, mutable=["intermediates"]
        ),
        variables,
        jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32),
    )
    inter = inter["intermediates"]
    assert inter["stage1_block3"]["__call__"][0].shape == (1, 56, 56, 256)
    sizes = {k: inter["stage2_block1"][k]["__call__"][0].shape[1:] for k in shapes}
    assert sizes == {
        "conv1": (56, 56, 128),
        "conv2": (28, 28, 128),
        "conv3": (28, 28, 512),
        "proj_conv": (28, 28, 512),
    }
    assert inter["stage4_block3"]["__call__"][0].shape == (1, 7, 7, 2048)


def test_params_have_logical_names():
    variables = abstract_variables(ResNetConfig(**SIZES["resnet50"]))
    expected = {
        "kernel": CONV_NAMES,
        "scale": ("channels",),
        "bias": ("channels",),
        "head_kernel": ("channels_in", "classes"),
        "head_bias": ("classes",),
    }
    flat = traverse_util.flatten_dict(variables["params"])
    assert len(flat) == 53 * 3 + 2  # 53 conv + BN pairs, the head
    for path, leaf in flat.items():
        assert isinstance(leaf, nn.Partitioned), path
        assert leaf.names == expected[path[-1]] and len(leaf.value.shape) == len(leaf.names)
    # Running averages are plain (replicated) float32 arrays.
    stats = jax.tree.leaves(variables["batch_stats"], is_leaf=lambda x: hasattr(x, "names"))
    assert all(not isinstance(s, nn.Partitioned) and s.dtype == jnp.float32 for s in stats)


def test_runs_under_mesh_with_logical_rules(f32_tiny):
    # Outside a mesh the annotations are no-ops; only here does a malformed one fail.
    cfg, variables = f32_tiny
    model = ResNet(cfg)
    rules = (
        ("batch", "data"),
        ("channels", "model"),
        ("channels_in", None),
        ("height", None),
        ("width", None),
        ("classes", None),
    )
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    x = images(3, 4)
    expected = appliers(cfg)[0](variables, x)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), x, train=False))
        spec = nn.get_partition_spec(boxed)["params"]["stage2_block1"]["conv1"]["kernel"]
        assert nn.logical_to_mesh_axes(spec) == PartitionSpec(None, None, None, "model")
        apply = jax.jit(lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]))
        replicated = jax.sharding.NamedSharding(mesh, PartitionSpec())
        got = apply(jax.device_put(variables, replicated), x)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5), got, expected)


def _matmul_flops(jaxpr) -> int:
    """2 * MACs of every conv and dot in a jaxpr (full kernel windows, padding included)."""
    total = 0
    for eqn in jaxpr.eqns:
        out = math.prod(eqn.outvars[0].aval.shape)
        if eqn.primitive.name == "conv_general_dilated":
            kernel = eqn.invars[1].aval.shape  # HWIO
            total += 2 * out * math.prod(kernel[:-1])
        elif eqn.primitive.name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            total += 2 * out * math.prod(eqn.invars[0].aval.shape[d] for d in contract)
    return total + sum(_matmul_flops(sub) for sub in subjaxprs(jaxpr))


def test_flops_formula():
    # Tiny at 32: stem 2*16^2*49*3*8 = 602,112; stage 1 2 * 2*8^2*9*8*8 = 147,456;
    # stage 2 (4x4 out) 2*16*9*8*16 + 2*16*9*16*16 + projection 2*16*8*16 = 114,688;
    # head 2*16*10 = 320.
    assert train_flops_per_example(tiny(), SIZE) == 3 * 864_576
    # ResNet-50 at 224: the well-known 4.09 GMACs forward, and exactly what the traced
    # program multiplies. (XLA's cost analysis counts ~3% less: it skips padding taps.)
    cfg = ResNetConfig(**SIZES["resnet50"])
    assert train_flops_per_example(cfg, 224) == 3 * 2 * 4_089_184_256
    jaxpr = jax.make_jaxpr(
        lambda v, x: ResNet(cfg).apply(v, x, train=True, mutable=["batch_stats"])
    )(abstract_variables(cfg), jax.ShapeDtypeStruct((1, 224, 224, 3), jnp.float32)).jaxpr
    assert 3 * _matmul_flops(jaxpr) == train_flops_per_example(cfg, 224)


def test_batch_norm_train_mode(f32_tiny):
    cfg, variables = f32_tiny
    x = images(4, 4)
    apply = jax.jit(
        lambda v, x: ResNet(cfg).apply(
            v,
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
            capture_intermediates=lambda module, _: module.name in ("stem_conv", "stem_bn"),
        )
    )
    logits, state = apply(variables, x)
    inter = state.pop("intermediates")
    np.testing.assert_allclose(logits, appliers(cfg)[0](variables, x)[0], rtol=1e-6)
    # Every running average moves: mean <- 0.9 mean + 0.1 batch mean; likewise the
    # (biased) variance. Checked on the stem, whose BN input is captured.
    old, new = variables["batch_stats"], state["batch_stats"]
    assert jax.tree.structure(old) == jax.tree.structure(new)
    leaves = zip(jax.tree.leaves(old), jax.tree.leaves(new), strict=True)
    assert all(not np.allclose(a, b) for a, b in leaves)
    h = inter["stem_conv"]["__call__"][0]  # [4, 16, 16, 8] float32
    mean, var = h.mean((0, 1, 2)), h.var((0, 1, 2))
    stem = old["stem_bn"]
    np.testing.assert_allclose(
        new["stem_bn"]["mean"], 0.9 * stem["mean"] + 0.1 * mean, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(new["stem_bn"]["var"], 0.9 * stem["var"] + 0.1 * var, rtol=1e-5)
    # The output is normalised with the batch statistics.
    bn = variables["params"]["stem_bn"]
    expected = (h - mean) / np.sqrt(var + 1e-5) * bn["scale"] + bn["bias"]
    np.testing.assert_allclose(inter["stem_bn"]["__call__"][0], expected, atol=1e-4)
    # So example 0's logits depend on the other examples.
    other = appliers(cfg)[0](variables, x.at[1:].set(images(5, 3)))[0]
    assert not np.allclose(logits[0], other[0], atol=1e-3)


def test_batch_norm_eval_mode(f32_tiny):
    cfg, variables = f32_tiny
    train, evaluate = appliers(cfg)
    x = images(6, 4)
    logits = evaluate(variables, x)
    assert not np.allclose(logits, train(variables, x)[0], atol=1e-3)
    # Running averages are read, never written (stats come back bit-identical).
    _, state = ResNet(cfg).apply(variables, x[:1], train=False, mutable=["batch_stats"])
    jax.tree.map(np.testing.assert_array_equal, state, {"batch_stats": variables["batch_stats"]})
    # Per-example: example 0 ignores the rest of the batch (and a batch of 1 agrees).
    other = evaluate(variables, x.at[1:].set(images(7, 3)))
    np.testing.assert_allclose(other[0], logits[0], rtol=1e-5, atol=1e-6)
    assert not np.allclose(other[1:], logits[1:], atol=1e-3)
    np.testing.assert_allclose(evaluate(variables, x[:1])[0], logits[0], rtol=1e-5, atol=1e-6)


R, B = 4, 2  # replicas, examples per replica


def vmapped(cfg: ResNetConfig):
    """Train-mode application vmapped over replicas: x [R, B, H, W, 3], variables shared."""
    model = ResNet(cfg)
    return jax.jit(
        jax.vmap(
            lambda v, x: model.apply(v, x, train=True, mutable=["batch_stats"]),
            in_axes=(None, 0),
            axis_name="replicas",
        )
    )


def assert_close(tree, expected, **tol):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, **tol), tree, expected)


def test_cross_replica_batch_norm(f32_tiny):
    cfg, variables = f32_tiny
    train = appliers(cfg)[0]
    x = images(8, R * B)
    split = x.reshape(R, B, *x.shape[1:])
    logits, state = train(variables, x)
    # Synchronised over all replicas: exactly BN over the whole [R * B] batch. Float32;
    # only the summation order of the statistics differs, hence rtol 1e-5.
    synced = dataclasses.replace(cfg, bn_axis_name="replicas")
    got_logits, got_state = vmapped(synced)(variables, split)
    np.testing.assert_allclose(got_logits.reshape(R * B, -1), logits, rtol=1e-5, atol=1e-5)
    assert_close(
        got_state,
        jax.tree.map(lambda s: np.broadcast_to(s, (R, *s.shape)), state),
        rtol=1e-5,
        atol=1e-6,
    )
    # Without an axis name every replica normalises with its own statistics.
    alone, _ = vmapped(cfg)(variables, split)
    assert not np.allclose(alone.reshape(R * B, -1), logits, atol=1e-3)
    # Groups of 2 replicas: BN over each half of the batch separately.
    grouped = dataclasses.replace(synced, bn_group_size=2)
    got_logits, got_state = vmapped(grouped)(variables, split)
    halves = [train(variables, half) for half in jnp.split(x, 2)]
    expected = jnp.concatenate([h[0] for h in halves])
    np.testing.assert_allclose(got_logits.reshape(R * B, -1), expected, rtol=1e-5, atol=1e-5)
    expected = jax.tree.map(lambda a, b: np.stack([a, a, b, b]), halves[0][1], halves[1][1])
    assert_close(got_state, expected, rtol=1e-5, atol=1e-6)
    # A group size must divide the number of replicas.
    with pytest.raises(ValueError, match="does not divide"):
        jax.eval_shape(vmapped(dataclasses.replace(synced, bn_group_size=3)), variables, split)


def test_cross_replica_batch_norm_gradients(f32_tiny):
    # As in the trainer: each replica differentiates its own loss; BN's all-reduce carries
    # cotangents between replicas, so the per-replica gradients sum to the gradient of the
    # whole batch's loss.
    cfg, variables = f32_tiny
    x, w = images(9, R * B), jnp.asarray(np.random.default_rng(0).standard_normal((R * B, 10)))
    model, synced = ResNet(cfg), ResNet(dataclasses.replace(cfg, bn_axis_name="replicas"))

    def loss(model, params, x, w):
        variables_ = {**variables, "params": params}
        logits, _ = model.apply(variables_, x, train=True, mutable=["batch_stats"])
        return jnp.sum(logits * w)

    per_replica = jax.jit(
        jax.vmap(
            jax.grad(lambda p, x, w: loss(synced, p, x, w)),
            in_axes=(None, 0, 0),
            axis_name="replicas",
        )
    )
    grads = per_replica(variables["params"], x.reshape(R, B, *x.shape[1:]), w.reshape(R, B, -1))
    expected = jax.jit(jax.grad(lambda p: loss(model, p, x, w)))(variables["params"])
    assert_close(jax.tree.map(lambda g: g.sum(0), grads), expected, rtol=2e-4, atol=2e-5)


@pytest.mark.slow  # ~8 s of compiles, cold
def test_bfloat16_params(f32_tiny):
    # The trainer may hand the model params already cast to bf16, also when differentiating.
    _, variables = f32_tiny
    cfg = tiny()  # bf16 compute
    train, evaluate = appliers(cfg)
    bf16 = {
        **variables,
        "params": jax.tree.map(lambda p: p.astype(jnp.bfloat16), variables["params"]),
    }
    x = images(11, 4)
    (train_logits, state), (train_ref, _) = train(bf16, x), train(variables, x)
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(state))  # running averages
    pairs = ((train_logits, train_ref), (evaluate(bf16, x), evaluate(variables, x)))
    for logits, ref in pairs:
        assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))
        # Only the rounding of the weights differs: compute is bf16 either way.
        np.testing.assert_allclose(logits, ref, atol=0.1)

    @jax.jit
    def grad(params):
        return jax.grad(lambda p: train({**bf16, "params": p}, x)[0].sum())(params)

    grads = jax.tree.leaves(grad(bf16["params"]))
    assert all(g.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(g))) for g in grads)
    assert all(bool(jnp.any(g != 0)) for g in grads)
