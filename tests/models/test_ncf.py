"""Tests of the NeuMF model, its loss and its ranking metrics."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from models import ncf

_AXES = {"users", "items", "embed", "mlp_in", "mlp", "logit"}


def _init(config, batch=4):
    ids = jnp.zeros((batch,), jnp.int32)
    return jax.jit(ncf.NCF(config).init)(jax.random.key(0), ids, ids)


def test_output_is_one_float32_logit_per_pair():
    config = ncf.NCFConfig(num_users=10, num_items=20)
    model = ncf.NCF(config)
    variables = _init(config)
    users = jnp.array([0, 3, 9, 9, 1], jnp.int32)
    items = jnp.array([19, 0, 5, 6, 1], jnp.int32)
    logits = model.apply(variables, users, items)
    assert logits.shape == (5,) and logits.dtype == jnp.float32
    # Pairs are scored independently: one pair alone gets the same logit, up to the
    # rounding of another program. At init a logit is a sum of terms far larger than
    # itself (8.5e-5 here, the largest logit 2.8e-3), so that rounding is absolute.
    alone = model.apply(variables, users[2:3], items[2:3], train=True)
    np.testing.assert_allclose(alone, logits[2:3], rtol=1e-6, atol=1e-6 * np.abs(logits).max())
    assert not np.allclose(logits[2], logits[3])


def test_param_count_flops_and_logical_names():
    config = ncf.NCFConfig(num_users=1000, num_items=500)
    ids = jnp.zeros((4,), jnp.int32)
    boxed = jax.eval_shape(ncf.NCF(config).init, jax.random.key(0), ids, ids)["params"]
    # Tables (1000 + 500) * (64 + 128); Dense 256x256, 256x128, 128x64 with biases;
    # output (64 + 64) + 1.
    expected = 1500 * 192 + (256 * 256 + 256) + (256 * 128 + 128) + (128 * 64 + 64) + 129
    assert expected == 395_073 == ncf.param_count(config)
    assert sum(x.size for x in jax.tree.leaves(nn.unbox(boxed))) == expected
    leaves = jax.tree.leaves(boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    assert len(leaves) == 4 + 2 * 4  # 4 tables; 3 hidden + 1 output Dense, kernel and bias.
    for leaf in leaves:
        assert isinstance(leaf, nn.Partitioned), "parameter without logical names"
        assert len(leaf.names) == len(leaf.value.shape) and set(leaf.names) <= _AXES
        assert leaf.value.dtype == jnp.float32
    names = {
        "/".join(k.key for k in path): leaf.names
        for path, leaf in jax.tree_util.tree_flatten_with_path(
            boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)
        )[0]
    }
    assert names["mf_user"] == ("users", "embed") and names["mlp_item"] == ("items", "embed")
    assert names["mlp_0/kernel"] == ("mlp_in", "mlp") and names["mlp_2/bias"] == ("mlp",)
    assert names["logits/kernel"] == ("mlp_in", "logit") and names["logits/bias"] == ("logit",)
    # 3 x 2 x (256*256 + 256*128 + 128*64 + 128*1) multiply-adds.
    assert ncf.train_flops_per_example(config) == 3 * 2 * 106_624
    with pytest.raises(ValueError, match="even"):
        ncf.NCFConfig(num_users=2, num_items=2, mlp_layers=(255, 64))


def test_runs_sharded_under_logical_rules():
    # Outside a mesh the logical annotations are no-ops, so only here does a wrongly shaped
    # or named annotation fail.
    config = ncf.NCFConfig(num_users=40, num_items=30, mf_dim=8, mlp_layers=(16, 8))
    model = ncf.NCF(config)
    boxed = _init(config)
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rules = (
        ("batch", "data"),
        ("users", "model"),
        ("items", "model"),
        ("embed", None),
        ("mlp_in", None),
        ("mlp", "model"),
        ("logit", None),
    )
    users = jnp.arange(16, dtype=jnp.int32)
    items = (users * 7) % 30
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, nn.logical_to_mesh_axes(spec, rules)),
        nn.get_partition_spec(boxed),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    variables = jax.device_put(nn.unbox(boxed), shardings)
    assert variables["params"]["mf_user"].sharding.spec == jax.sharding.PartitionSpec("model", None)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        logits = jax.jit(model.apply)(variables, users, items)
    expected = model.apply(nn.unbox(boxed), users, items)
    np.testing.assert_allclose(logits, expected, rtol=2e-2, atol=1e-6)


def test_flops_match_xla_cost_analysis():
    config = ncf.NCFConfig(num_users=100, num_items=50, dtype=jnp.float32)
    model, ids = ncf.NCF(config), jnp.zeros((8,), jnp.int32)
    variables = jax.eval_shape(model.init, jax.random.key(0), ids, ids)
    cost = jax.jit(model.apply).lower(variables, ids, ids).cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    # XLA also counts the GMF product, biases and ReLUs, which the formula ignores.
    assert 1.0 < cost["flops"] / (8 * ncf.train_flops_per_example(config) / 3) < 1.05


def test_loss_and_metrics_match_hand_computation():
    logits = jnp.array([2.0, -1.0, 0.5, 0.0])
    labels = jnp.array([1.0, 0.0, 0.0, 1.0])
    weights = jnp.array([1.0, 1.0, 1.0, 0.0])  # The last row is padding.
    # BCE = log(1 + e^x) - y x:
    #   x=2, y=1:    log(1 + e^-2) = 0.126928   correct (2 > 0, label 1)
    #   x=-1, y=0:   log(1 + e^-1) = 0.313262   correct (-1 <= 0, label 0)
    #   x=0.5, y=0:  log(1 + e^.5) = 0.974077   wrong   (0.5 > 0, label 0)
    #   padding (would be log 2) does not count.
    expected = math.log1p(math.exp(-2)) + math.log1p(math.exp(-1)) + math.log1p(math.exp(0.5))
    assert expected == pytest.approx(1.414267, abs=1e-6)
    loss, metrics = ncf.loss_and_metrics(logits, labels, weights)
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(metrics["loss"]) == float(loss)
    assert float(metrics["accuracy"]) == 2.0 and float(metrics["weight"]) == 3.0
    # Stable for large logits (no overflow to inf).
    big, _ = ncf.loss_and_metrics(jnp.array([100.0, -100.0]), jnp.array([0.0, 1.0]), jnp.ones(2))
    assert float(big) == pytest.approx(200.0)


def test_hit_rate_and_ndcg_match_hand_computation():
    scores = jnp.array(
        [
            [0.9, 0.1, 0.2, 0.3],  # A: no negative >= 0.9           -> rank 0
            [0.5, 0.7, 0.1, 0.2],  # B: one negative above           -> rank 1
            [0.5, 0.5, 0.9, 0.1],  # C: one above, one tie (counts)  -> rank 2
            [0.3, 0.3, 0.3, 0.3],  # D: constant model, all ties     -> rank 3
            [1.0, 0.0, 0.0, 0.0],  # E: padding (would be rank 0)
        ]
    )
    weights = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
    # k=2: A hits (NDCG 1/log2(2) = 1), B hits (1/log2(3) = 0.630930); C misses only
    # because of the pessimistic tie (optimistically it would be rank 1); D misses.
    hr, ndcg = ncf.hit_rate_and_ndcg(scores, k=2, weights=weights)
    assert float(hr) == 2.0
    assert float(ndcg) == pytest.approx(1 + 0.630930, abs=1e-6)
    # k=10: all four hit; NDCG 1 + 1/log2(3) + 1/log2(4) + 1/log2(5) = 1 + .630930 + .5 + .430677.
    hr, ndcg = ncf.hit_rate_and_ndcg(scores, k=10, weights=weights)
    assert float(hr) == 4.0
    assert float(ndcg) == pytest.approx(2.561606, abs=1e-6)
    # The positive in another column; no weights means every row counts (E is rank 0).
    moved = jnp.roll(scores, 2, axis=1)
    hr, ndcg = jax.jit(ncf.hit_rate_and_ndcg, static_argnames="k")(moved, 2, k=2)
    assert float(hr) == 3.0 and float(ndcg) == pytest.approx(2.630930, abs=1e-6)
    # NaNs count against the positive: a NaN positive ranks last (rank 2, a miss at k=2),
    # a NaN negative ranks above it (rank 1, a miss at k=1).
    hr, _ = ncf.hit_rate_and_ndcg(jnp.array([[jnp.nan, 0.0, 1.0], [0.5, jnp.nan, 0.0]]), k=2)
    assert float(hr) == 1.0
    hr, _ = ncf.hit_rate_and_ndcg(jnp.array([[0.5, jnp.nan, 0.0]]), k=1)
    assert float(hr) == 0.0


def _grouped_problem(rng):
    """64 users and 128 items in 4 groups; each user likes 12 items of its own group.

    Returns (positives [64, 12], held-out item [64], eval items [64, 51] with the held-out
    positive in column 0 and 50 negatives the user never liked).
    """
    num_users, num_items, groups = 64, 128, 4
    positives = np.stack(
        [rng.choice(np.arange(u % groups, num_items, groups), 12, replace=False) for u in range(64)]
    )
    liked = np.zeros((num_users, num_items), bool)
    liked[np.arange(num_users)[:, None], positives] = True
    negatives = np.stack([rng.choice(np.flatnonzero(~row), 50, replace=False) for row in liked])
    return positives, liked, np.concatenate([positives[:, :1], negatives], axis=1)


def test_adam_training_beats_random_hit_rate():
    rng = np.random.default_rng(0)
    positives, liked, eval_items = _grouped_problem(rng)
    config = ncf.NCFConfig(num_users=64, num_items=128, mf_dim=8, mlp_layers=(16, 16, 8))
    model = ncf.NCF(config)
    params = nn.unbox(_init(config))["params"]
    # Train on 11 positives per user (column 0 is held out) plus 4 negatives per positive.
    train_users = np.repeat(np.arange(64), 11)
    train_items = positives[:, 1:].reshape(-1)
    optimizer = optax.adam(0.02)

    @jax.jit
    def step(params, opt_state, users, items, labels):
        def loss_fn(params):
            logits = model.apply({"params": params}, users, items, train=True)
            loss, _ = ncf.loss_and_metrics(logits, labels, jnp.ones_like(labels))
            return loss / labels.size

        grads = jax.grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    @jax.jit
    def evaluate(params):
        users = jnp.broadcast_to(jnp.arange(64)[:, None], eval_items.shape)
        scores = model.apply({"params": params}, users.reshape(-1), eval_items.reshape(-1))
        return ncf.hit_rate_and_ndcg(scores.reshape(eval_items.shape), k=10)

    random_hr = 10 / 51
    hr_before, _ = evaluate(params)
    opt_state = optimizer.init(params)
    users = np.concatenate([train_users] * 5)
    labels = np.repeat([1.0, 0.0], [704, 4 * 704]).astype(np.float32)
    for _ in range(200):
        # Negatives: uniform over items the user never liked (held-out positive included).
        negatives = rng.integers(0, 128, size=4 * 704)
        clash = liked[users[704:], negatives]
        while clash.any():
            negatives[clash] = rng.integers(0, 128, size=clash.sum())
            clash = liked[users[704:], negatives]
        items = np.concatenate([train_items, negatives])
        params, opt_state = step(params, opt_state, users, items, labels)
    hr, ndcg = (float(x) / 64 for x in evaluate(params))
    # About 0.70 and 0.59 (0.23 before training). In-group negatives (~9 of the 50) are
    # hard, the rest easy.
    assert hr > 2.5 * random_hr and ndcg > 0.3, (float(hr_before) / 64, hr, ndcg)
