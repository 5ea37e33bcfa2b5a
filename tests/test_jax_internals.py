"""The one table of what the project reads of JAX that JAX does not promise
(trainer/jax_internals.py), checked against the installed JAX: a release that moves
a private name, renames a primitive or reshapes how one calls its sub-jaxprs fails
here, naming it, and not as bytes silently lost in a user's run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from trainer import jax_internals
from trainer.parallel import precision


@pytest.mark.parametrize("what", list(jax_internals.PRIVATE))
def test_the_private_jax_names_it_reads_are_still_there(what):
    value = jax_internals.private(what)
    if what == "cluster types":
        names = {env.__name__ for env in value}
        assert {"SlurmCluster", "OmpiCluster", "GceTpuCluster", "GkeTpuCluster"} <= names
        assert all(callable(env.is_env_present) for env in value)
    elif what == "distributed runtime client":
        # None until jax.distributed.initialize (tests/training/test_multihost.py uses it).
        assert value is None
    else:
        assert isinstance(value, bool)


def _bf16(x):
    return x.astype(jnp.bfloat16)


@jax.custom_vjp
def _custom_vjp(x):
    return _bf16(x)


_custom_vjp.defvjp(lambda x: (_bf16(x), None), lambda _, g: (g.astype(jnp.float32),))


@jax.custom_jvp
def _custom_jvp(x):
    return _bf16(x)


_custom_jvp.defjvp(lambda p, t: (_bf16(p[0]), _bf16(t[0])))


def _scan_of_layers(p, x):
    # A stack's slices (xs) and a shared weight (a constant), rounded in the body.
    def body(h, layer):
        h = (_bf16(h) @ _bf16(layer)).astype(jnp.float32) + _bf16(p["shared"]).sum()
        return h, None

    return jax.lax.scan(body, x, p["stack"])[0]


# Name -> (the use of parameter p, whether every use rounds it to bf16, whether it
# may also reach the use rounded: nothing of its gradient summed before the rounding).
# Each kind of the table's CALLS is followed into, and what must not be followed is not.
CASES = {
    "plain cast": (lambda p, x: _bf16(p["w"]).sum(), True, True),
    "moved, then cast": (lambda p, x: _bf16(p["w"].T.reshape(-1)[:4]).sum(), True, True),
    "cast, then used twice": (lambda p, x: (lambda b: (b @ b).sum())(_bf16(p["w"])), True, True),
    "used twice, then cast": (
        lambda p, x: _bf16(p["w"]).sum() + _bf16(p["w"].T).max(),
        True,
        False,
    ),
    "rows looked up, then cast": (
        lambda p, x: _bf16(jnp.take(p["w"], x.astype(jnp.int32), axis=0)).sum(),
        True,
        False,
    ),
    "broadcast, then cast": (
        lambda p, x: _bf16(jnp.broadcast_to(p["w"], (3, 4, 4))).sum(),
        True,
        False,
    ),
    "used in float32": (lambda p, x: (p["w"] * 2).sum(), False, False),
    "cast to float16": (lambda p, x: p["w"].astype(jnp.float16).sum(), False, False),
    "jit": (lambda p, x: jax.jit(_bf16)(p["w"]).sum(), True, True),
    "remat": (lambda p, x: jax.checkpoint(lambda w: _bf16(w) * 2)(p["w"]).sum(), True, True),
    # A derivative of the user's may sum anything: not kept.
    "custom_vjp": (lambda p, x: _custom_vjp(p["w"]).sum(), True, False),
    "custom_jvp": (lambda p, x: _custom_jvp(p["w"]).sum(), True, False),
    "cond": (
        lambda p, x: jax.lax.cond(x.sum() > 0, _sum_bf16, _max_bf16, p["w"]),
        True,
        True,
    ),
    "cond, one branch in float32": (
        lambda p, x: jax.lax.cond(x.sum() > 0, _sum_bf16, jnp.sum, p["w"]),
        False,
        False,
    ),
    # A stack's slices, one a trip, against a constant used on every trip.
    "scan over its rows": (
        lambda p, x: jax.lax.scan(lambda c, row: (c + _sum_bf16(row), None), 0.0, p["w"])[0],
        True,
        True,
    ),
    "scan constant": (
        lambda p, x: jax.lax.scan(lambda c, _: (c + _sum_bf16(p["w"]), None), 0.0, x)[0],
        True,
        False,
    ),
    # A carry comes back from the body as the next trip's input: not followed out of
    # a loop (conservative: here it is only transposed).
    "scan carry": (
        lambda p, x: jax.lax.scan(lambda c, _: (c.T, _sum_bf16(c)), p["w"], x)[1].sum(),
        False,
        False,
    ),
    # Not in the table (its condition and body take different operands): not followed.
    "while": (
        lambda p, x: jax.lax.while_loop(
            lambda c: c[0] < 2, lambda c: (c[0] + 1, c[1] + _sum_bf16(p["w"])), (0, 0.0)
        )[1],
        False,
        False,
    ),
}


def _sum_bf16(w):
    return _bf16(w).sum().astype(jnp.float32)


def _max_bf16(w):
    return _bf16(w).max().astype(jnp.float32)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_precision_pass_follows_every_kind_of_call(name):
    use, rounded, kept = CASES[name]
    params = {"w": jnp.ones((4, 4))}
    flags = precision.params_precision(use, params, jnp.ones((2, 4)), low_dtype=jnp.bfloat16)
    assert flags == precision.Precision(low={"w": rounded}, kept={"w": kept})


# Name -> a loss of weights w [3, 4, 4] whose cotangents are not round numbers, so that
# summing them in bf16 shows.
GRADIENT_CASES = {
    "a stack's layers, scanned": lambda w, x: jax.lax.scan(
        lambda h, layer: (jnp.tanh(_bf16(h) @ _bf16(layer)).astype(jnp.float32), None), x, w
    )[0].sum(),
    "moved, then cast once": lambda w, x: (_bf16(x) @ _bf16(w.transpose(0, 2, 1)[1])).sum(),
    "used twice, then cast": lambda w, x: (
        jnp.tanh(_bf16(x) @ _bf16(w[0])).astype(jnp.float32).sum()
        + jnp.cos(_bf16(x) @ _bf16(w[0])).astype(jnp.float32).sum()
    ),
    "rows looked up, then cast": lambda w, x: (
        jnp.tanh(_bf16(jnp.take(w[0], jnp.array([1, 1, 1, 2]), axis=0)) @ _bf16(x.T))
        .astype(jnp.float32)
        .sum()
    ),
    "a constant of the loop": lambda w, x: jax.lax.scan(
        lambda h, _: (jnp.tanh(_bf16(h) @ _bf16(w[0])).astype(jnp.float32), None),
        x,
        None,
        length=3,
    )[0].sum(),
}


@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_a_weight_is_kept_rounded_exactly_where_its_gradient_is_unchanged(name):
    # The independent check of the pass's second answer: the gradient of weights handed
    # over already rounded to bf16 (cast up, as the reduction does), against that of the
    # float32 weights.
    loss = GRADIENT_CASES[name]
    w = jax.random.normal(jax.random.key(0), (3, 4, 4), jnp.float32)
    x = jax.random.normal(jax.random.key(1), (2, 4), jnp.float32)
    kept = precision.params_precision(loss, w, x, low_dtype=jnp.bfloat16).kept
    got = jax.grad(loss)(w.astype(jnp.bfloat16), x)
    assert got.dtype == jnp.bfloat16
    want = jax.grad(loss)(w, x)
    assert kept == bool(jnp.array_equal(got.astype(jnp.float32), want)), (kept, got - want)


def test_the_precision_pass_follows_a_scan_over_layers_and_shard_map():
    params = {"stack": jnp.ones((3, 4, 4)), "shared": jnp.ones((4,)), "norm": jnp.ones((4,))}

    def loss(p, x):
        h = _scan_of_layers(p, x) * p["norm"]  # the norm scale in float32
        mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
        inside = jax.shard_map(_bf16, mesh=mesh, in_specs=P(), out_specs=P())(p["stack"])
        return h.sum() + inside.sum()

    flags = precision.params_precision(loss, params, jnp.ones((2, 4)), low_dtype=jnp.bfloat16)
    assert flags.low == {"stack": True, "shared": True, "norm": False}
    # The stack is used twice (the scan and the shard_map); the shared weight on every trip.
    assert flags.kept == {"stack": False, "shared": False, "norm": False}


def test_every_call_primitive_it_follows_exists_under_this_jax():
    # The primitives that the functions above trace to are in the table, by the names
    # this JAX gives them; table entries for older JAX names are allowed to be unseen.
    seen = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            seen.add(eqn.primitive.name)
            for sub in jax_internals.sub_jaxprs(eqn):
                walk(sub)

    x = jnp.ones((2, 4))
    for use, *_ in CASES.values():
        walk(jax.make_jaxpr(use)({"w": jnp.ones((4, 4))}, x).jaxpr)
    calls = seen & set(jax_internals.CALLS)
    assert {"scan", "cond"} <= calls
    assert len(calls) >= 6, sorted(seen)
    assert jax_internals.CAST[0] in seen
