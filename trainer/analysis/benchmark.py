"""Timing the training loop on this host's devices, per update-sharding mode
(``python -m trainer.bench``): step time, per-device state and temporaries,
collective bytes per step from the HLO after SPMD partitioning, checkpoint saves."""

from __future__ import annotations

import functools
import math
import os
import statistics
import time

import jax
import numpy as np

from trainer import checkpoint as checkpoint_lib
from trainer.analysis import hlo
from trainer.input import feed as feed_lib
from trainer.parallel import batches
from trainer.parallel import mesh as mesh_lib
from trainer.training import experiment


def plan_mode(config, mode: str) -> dict:
    """The sharding plan of ``config`` under update-sharding ``mode`` on this process's
    devices, without data, initial state or a compile: the per-parameter layouts
    (``"plan"``) and where the groups sit (``"groups"``)."""
    config = config.copy_and_resolve_references()
    config.optimizer.update_sharding = mode
    exp = experiment.build(config, with_data=False)
    num_slices = math.prod(config.mesh.dcn_axes.values())
    return {
        "plan": [list(map(str, row)) for row in exp.plan.table(num_slices)],
        "groups": mesh_lib.describe_groups(exp.mesh, num_slices),
    }


def bench_mode(
    config,
    mode: str,
    loop_lengths: list[int],
    loops: int,
    peak: float,
    checkpoint_dir: str | None = None,
) -> dict:
    """Compiles and times the training loop of ``config`` under update-sharding
    ``mode`` on this process's devices; returns its figures.

    Args:
      config: the run config.
      mode: ``none``, ``wus`` or ``fsdp``.
      loop_lengths: the loop lengths K to time (the first one also gives memory
        and collective figures).
      loops: timed loops per length, after one warm-up loop.
      peak: all devices' peak FLOP/s for MFU (0: none).
      checkpoint_dir: also time async vs sync checkpoint saves of the state there.
    """
    config = config.copy_and_resolve_references()
    config.optimizer.update_sharding = mode
    exp = experiment.build(config)
    state = exp.init()
    feed = feed_lib.Feed(
        exp.task.train_data, functools.partial(batches.to_global, exp.mesh, stacked=True)
    )

    def per_device(tree) -> int:
        return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))

    num_slices = math.prod(config.mesh.dcn_axes.values())
    result = {
        "state_bytes_per_device": per_device((state.params, state.opt_state)),
        "plan": [list(map(str, row)) for row in exp.plan.table(num_slices)],
        "groups": mesh_lib.describe_groups(exp.mesh, num_slices),
    }
    for i, k in enumerate(loop_lengths):
        stacked, _ = feed.next(k)
        compiled, text = hlo.compile_with_dump(experiment.lower_loop(exp, k))
        state, _ = compiled(state, stacked)  # warm-up
        jax.block_until_ready(state)
        times = []
        for _ in range(loops):
            start = time.perf_counter()
            state, metrics = compiled(state, stacked)
            jax.block_until_ready((state, metrics))
            times.append((time.perf_counter() - start) / k)
        step_time = statistics.median(times)
        examples = config.global_batch_size / step_time
        figures = {
            "step_time_s": step_time,
            "examples_per_sec": examples,
            "mfu": exp.task.flops_per_example * examples / peak if peak else float("nan"),
        }
        if i == 0:
            memory = compiled.memory_analysis()
            figures |= {
                "steps_per_loop": k,
                "argument_bytes": int(memory.argument_size_in_bytes),
                "temp_bytes": int(memory.temp_size_in_bytes),
                "collective_bytes": hlo.bytes_by_kind(
                    hlo.collectives(text, jax.device_count()), steps_per_loop=k
                ),
                "final_loss": float(np.sum(metrics["loss"]) / np.sum(metrics["weight"])),
            }
            result |= figures
        result.setdefault("by_steps_per_loop", {})[str(k)] = figures
    if checkpoint_dir:
        result["checkpoint"] = bench_checkpoint(exp, state, feed, f"{checkpoint_dir}/{mode}")
    feed.close()
    return result


def bench_checkpoint(exp, state, feed, directory: str, repeats: int = 3) -> dict:
    """Time the training loop is blocked by an async save vs a sync one, and the
    bytes on disk vs the bytes of params + optimizer state."""
    with jax.set_mesh(exp.mesh):
        logical = exp.to_logical(state)
    jax.block_until_ready(logical)
    data_state = feed.position
    out = {}
    for name, async_save in (("async", True), ("sync", False)):
        ckpt = checkpoint_lib.Checkpointer(
            os.path.join(directory, name), keep=1, async_save=async_save
        )
        blocked = []
        for step in range(1, repeats + 1):
            start = time.perf_counter()
            ckpt.save(step, logical, data_state, exp.config)
            blocked.append(time.perf_counter() - start)
            ckpt.wait()
        ckpt.close()
        out[f"{name}_blocking_s"] = statistics.median(blocked)
    latest = os.path.join(directory, "sync", "checkpoints", str(repeats), "state")
    out["disk_bytes"] = sum(
        os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(latest) for f in files
    )
    out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves((logical.params, logical.opt_state)))
    return out
