"""Estimated step time of a program compiled for a TPU topology.

The estimate is built from published hardware figures (:mod:`trainer.hardware`)
and what the compiler reports; no constant is fitted to any measured step time.
Its assumptions, which the README repeats:

* Compute: XLA's ``optimal_seconds`` of the compiled (per-device) program, a
  per-instruction roofline: the sum over instructions of ``max(flops / peak,
  bytes accessed / HBM bandwidth)`` with the compiler's own figures for the chip
  (measured for v3: 61.5 TFLOP/s and 400 GiB/s per core, against the published
  61.5 TFLOP/s and 450 GB/s). Per instruction matters: a memory-bound weight
  update does not hide under compute-bound matmuls. A whole-program roofline,
  ``max(flops / peak, bytes / bandwidth)`` with the published figures
  (:func:`roofline_seconds`), is the fallback where XLA gives none. XLA counts a
  ``while`` body once, so a K-step loop reports about one step (plus the little
  outside the loop), and it counts the HBM traffic of collectives but not their
  network time, which is added below.
* Each collective is bandwidth-bound over ICI; per-hop latency and start-up
  costs are ignored (so many tiny collectives are underestimated). Data moves
  between chips: the cores of one chip (v2/v3) combine their parts through HBM
  first, which is not counted, and a chip whose cores sit in different groups
  of the same collective shares its links between them.
* A replica group spans, in each torus dimension, the chips it touches. A ring
  along a dimension runs at 2 x the one-way link bandwidth when the group spans
  the whole dimension of a slice that wraps around (torus), else at 1 x (a line:
  data flows out and back). A collective uses all its spanned dimensions at once
  (the TPU's multi-dimensional ring emitters), except one whose emitter name
  says ``1D``, which uses its best single dimension.
* Per-device bytes moved, with n chips in the group and S the whole buffer
  (:attr:`trainer.hlo.Collective.buffer_bytes`): all-gather and reduce-scatter
  ``(n-1)/n S``; all-reduce ``2 (n-1)/n S``; all-to-all ``(n-1)/n S``;
  collective-permute ``S`` over one link. What the back end performs is what is
  counted: an all-reduce that stands for a reduce-scatter (+ dynamic-slice) or
  for an all-gather (of a zero-filled buffer) costs an all-reduce.
* Collectives inside the loop body run once per step; those outside it once per
  K steps. Step time ranges from full overlap, ``max(compute, async
  collectives) + synchronous collectives``, to none, ``compute + all
  collectives``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from trainer.hardware import Accelerator
from trainer.hlo import Collective


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the devices of a compiled program sit.

    Attributes:
      accelerator: the table row of the devices.
      chip_of: per partition id (the program's device order), the chip's
        coordinates.
      shape: chips along each dimension of the slice.
      wraps: per torus dimension, whether the slice closes it into a ring.
    """

    accelerator: Accelerator
    chip_of: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    wraps: tuple[bool, ...]

    @classmethod
    def from_devices(cls, accelerator: Accelerator, devices: Sequence) -> Topology:
        """From the devices in the program's order (``mesh.devices.flat``)."""
        dims = max(accelerator.torus_dims, 1)
        chip_of = tuple(tuple(d.coords[:dims]) for d in devices)
        shape = tuple(max(c[i] for c in chip_of) + 1 for i in range(dims))
        if accelerator.pod_shape:
            # A dim wraps only when the slice spans the pod's whole dim.
            wraps = tuple(
                s == p and s > 2 for s, p in zip(shape, accelerator.pod_shape, strict=False)
            )
        else:
            # Optical switches close every dim of a slice made of whole 4x4x4 cubes.
            cubes = all(s % 4 == 0 for s in shape)
            wraps = tuple(cubes for _ in shape)
        return cls(accelerator, chip_of, shape, wraps)


def collective_seconds(c: Collective, topo: Topology) -> float:
    """Bandwidth-bound time of one collective on ``topo`` (see module docstring)."""
    acc = topo.accelerator
    chips = [topo.chip_of[i] for i in c.group]
    distinct = set(chips)
    n = len(distinct)
    size = c.buffer_bytes
    if n <= 1:
        # Only the cores of one chip: a copy through HBM.
        return size / acc.hbm_bandwidth if len(c.group) > 1 else 0.0
    link = acc.ici_link_bandwidth
    per_dim = []
    for d, extent in enumerate(topo.shape):
        spanned = len({chip[d] for chip in distinct})
        if spanned > 1:
            ring = spanned == extent and topo.wraps[d]
            per_dim.append(2 * link if ring else link)
    bandwidth = max(per_dim) if c.emitter.startswith("1D") else sum(per_dim)
    # Cores of one chip in different groups of this collective share its links.
    cores_here = len(c.group) / n
    bandwidth *= cores_here / acc.devices_per_chip
    frac = (n - 1) / n
    if c.kind == "all-reduce":
        return 2 * frac * size / bandwidth
    if c.kind == "collective-permute":
        return size / link
    return frac * size / bandwidth


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The pieces of an estimated step time, in seconds.

    Attributes:
      compute_s: roofline time of the per-device program.
      async_collective_s: collectives issued as start/done pairs, per step.
      sync_collective_s: the other collectives, per step.
      overlap_s: ``max(compute, async) + sync``.
      no_overlap_s: ``compute + async + sync``.
    """

    compute_s: float
    async_collective_s: float
    sync_collective_s: float

    @property
    def overlap_s(self) -> float:
        return max(self.compute_s, self.async_collective_s) + self.sync_collective_s

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.async_collective_s + self.sync_collective_s


def roofline_seconds(flops: float, bytes_accessed: float, accelerator: Accelerator) -> float:
    """Whole-program roofline of one device with the published peak and bandwidth."""
    return max(flops / accelerator.peak_flops, bytes_accessed / accelerator.hbm_bandwidth)


def estimate_step(
    *,
    compute_s: float,
    collectives: Sequence[Collective],
    topo: Topology,
    steps_per_loop: int,
    has_loop: bool,
) -> tuple[StepEstimate, list[float]]:
    """The step-time estimate and each collective's per-step seconds.

    Args:
      compute_s: per-device compute time of one step (XLA's optimal_seconds).
      collectives: the compiled program's collectives.
      topo: where its devices sit.
      steps_per_loop: K, the steps one call of the program runs.
      has_loop: whether the program has the K-step ``while`` loop (K = 1 unrolls
        it: then everything runs once per step).
    """
    seconds = []
    for c in collectives:
        per_call = collective_seconds(c, topo)
        seconds.append(per_call if c.in_loop or not has_loop else per_call / steps_per_loop)
    async_s = math.fsum(s for s, c in zip(seconds, collectives, strict=True) if c.is_async)
    sync_s = math.fsum(s for s, c in zip(seconds, collectives, strict=True) if not c.is_async)
    return StepEstimate(compute_s, async_s, sync_s), seconds
