"""Reading a compiled program's loops: a collective inside a scan of known length is
counted once per trip, however deep the loops nest."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, PartitionSpec

from trainer.analysis import hlo


def test_a_collective_in_a_scan_runs_once_per_trip():
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))

    def per_device(x):
        def layer(h, _):
            return h + jax.lax.psum(h * 2.0, "data"), None  # one all-reduce a trip

        def step(h, _):
            h, _ = jax.lax.scan(layer, h, None, length=7)
            return h - jax.lax.pmean(h, "data"), None  # one more a step

        h, _ = jax.lax.scan(step, x, None, length=3)
        return h

    fn = jax.jit(
        jax.shard_map(
            per_device, mesh=mesh, in_specs=PartitionSpec("data"), out_specs=PartitionSpec("data")
        )
    )
    text = fn.lower(jnp.ones((8, 16), np.float32)).compile().as_text()
    found = hlo.collectives(text, 8)
    trips = sorted(c.trips for c in found if c.kind == "all-reduce")
    assert trips == [3, 21]  # the step's, 3 steps; the layer's, 3 x 7
    assert sorted(c.loop_depth for c in found if c.kind == "all-reduce") == [1, 2]
    # Per step of a 3-step program: once and 7 times.
    assert sorted(c.per_step(3, True) for c in found) == [1.0, 7.0]
    assert not hlo.loops(hlo.computations(text)).unread
