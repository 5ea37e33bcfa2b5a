"""Reading a compiled program's loops: a collective inside a scan of known length is
counted once per trip, however deep the loops nest."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


# The TPU partitioner's windowed einsum loop, cut down from the v5e-128b program
# (libtpu 0.0.52, an MLP matmul under tensor parallelism): its u32 counter goes 0, 2,
# 4, 6 against 8, each trip computing two blocks; the body also adds 1 to the counter
# for the next block's index, which is not the step.
WINDOWED = """HloModule windowed

%cond (p: (u32[], f32[4])) -> pred[] {
  %p = (u32[], f32[4]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%p), index=0
  %n = u32[]{:T(128)} constant(8)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (q: (u32[], f32[4])) -> (u32[], f32[4]) {
  %q = (u32[], f32[4]) parameter(0)
  %i = u32[]{:T(128)} get-tuple-element(%q), index=0
  %one = u32[]{:T(128)} constant(1)
  %next_block = u32[]{:T(128)} add(%i, %one)
  %step = u32[]{:T(128)} constant(STEP)
  %i2 = u32[]{:T(128)} add(%i, %step)
  %x = f32[4] get-tuple-element(%q), index=1
  ROOT %t = (u32[], f32[4]) tuple(%i2, /*index=1*/%x)
}

ENTRY %main (x: f32[4]) -> (u32[], f32[4]) {
  %x = f32[4] parameter(0)
  %zero = u32[] constant(0)
  %init = (u32[], f32[4]) tuple(%zero, %x)
  ROOT %w = (u32[], f32[4]) while(%init), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("step, trips", [(2, 4), (1, 8), (3, 3)])
def test_a_loop_without_a_known_trip_count_counts_by_its_step(step, trips):
    text = WINDOWED.replace("STEP", str(step))
    bodies = hlo.computations(text)
    line = next(t for t in bodies["main"] if " while(" in t)
    assert hlo.trip_count(line, bodies) == trips
    assert hlo.loops(bodies).trips["body"] == trips
