"""Whether moving bf16 as its bits pays on XLA:CPU: the project's collectives on 8
simulated CPU devices, each with ``bits`` off (XLA:CPU moves bf16 in f32) and on
(``trainer.parallel.collectives.gathers_bits``), timed in alternating rounds.

    python scripts/collective_bits.py --rounds 7

The shapes are the 64M decoder's of scripts/maxtext_side_by_side.py: its output
table ``[32,000, 512]`` gathered from 8 row shards (as ``wus``, ``fsdp`` and
``per_layer`` gather it) and transposed, as the output projection reads it; and its
input table's rows looked up for 8 rows of 128 tokens a device, forward and backward
(``collectives.sharded_lookup``, as ``per_layer`` reads that table).
Prints each variant's milliseconds a call, every round and the median, with the load.
The simulated devices share this machine's cores: compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from trainer.parallel import collectives  # noqa: E402
from trainer.parallel import mesh as mesh_lib  # noqa: E402
from trainer.parallel.layout import LeafLayout  # noqa: E402

VOCAB, FEATURES, TOKENS = 32_000, 512, 8 * 128


def programs(mesh) -> dict[str, tuple]:
    """name -> (program, its arguments), each with bits off and on."""
    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.normal(size=(VOCAB, FEATURES)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, VOCAB, size=(8, TOKENS)), jnp.int32)
    lay = LeafLayout((VOCAB, FEATURES), ((), ()), sharded=True, start=0, stop=1)
    out = {}
    for bits in (False, True):
        suffix = "bits" if bits else "float"

        def gather(shard, bits=bits):
            # Transposed, as the output projection reads it (without the barrier in
            # all_gather, XLA:CPU fuses the bits' bitcast into this transpose badly).
            return collectives.all_gather(shard.astype(jnp.bfloat16), 0, bits=bits).T

        out[f"gather, {suffix}"] = (
            jax.jit(
                jax.shard_map(gather, mesh=mesh, in_specs=P("data"), out_specs=P(None, "data"))
            ),
            (table,),
        )
        lookup = collectives.sharded_lookup(
            lay, 8, jnp.float32, jnp.bfloat16, jnp.float32, False, bits=bits
        )

        def looked_up(shard, ids, lookup=lookup):
            rows, vjp = jax.vjp(lambda s: lookup(s, ids[0]), shard)
            return vjp(rows)[0]

        out[f"lookup, {suffix}"] = (
            jax.jit(
                jax.shard_map(
                    looked_up,
                    mesh=mesh,
                    in_specs=(P("data"), P("data")),
                    out_specs=P("data"),
                    check_vma=False,
                )
            ),
            (table, ids),
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=10, help="calls timed a round")
    args = parser.parse_args()
    mesh = mesh_lib.make_mesh({"data": 8, "model": 1})
    progs = programs(mesh)
    for program, arguments in progs.values():  # compile and warm up
        jax.block_until_ready(program(*arguments))
    times: dict[str, list[float]] = {name: [] for name in progs}
    for _ in range(args.rounds):
        for name, (program, arguments) in progs.items():
            start = time.perf_counter()
            for _ in range(args.calls):
                out = program(*arguments)
            jax.block_until_ready(out)
            times[name].append((time.perf_counter() - start) / args.calls * 1e3)
    for name, ms in times.items():
        rounds = " ".join(f"{t:.1f}" for t in ms)
        print(f"{name:15s} median {statistics.median(ms):6.1f} ms  (rounds: {rounds})")
    print("load average (1, 5, 15 min): {:.1f} {:.1f} {:.1f}".format(*os.getloadavg()))


if __name__ == "__main__":
    main()
