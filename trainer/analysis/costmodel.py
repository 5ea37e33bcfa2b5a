"""Estimated step time of a program compiled for a TPU topology, under named
assumptions about how its collectives use the links.

Nothing here is fitted to a measured step time; every constant is a published
figure (:mod:`trainer.parallel.hardware`, and the latencies below). What the compiler
runs is read from its output: each collective's replica groups (which chips, in
ring order) and its ``backend_config`` (:class:`trainer.analysis.hlo.Algorithm`), and
what each algorithm does on the links was read from libtpu's own low-level program
(:func:`reading`; README, "What the TPU back end does with our collectives").

* Compute: XLA's ``optimal_seconds`` of the compiled per-device program, a
  per-instruction roofline with the compiler's own figures for the chip
  (measured for v3: 61.5 TFLOP/s and 400 GiB/s per core); a whole-program
  roofline with the published figures (:func:`roofline_seconds`) where XLA
  gives none. XLA counts a ``while`` body once, so a K-step loop reports about
  one step, and it counts the HBM traffic of collectives but not their network
  time, which is added below.
* A collective moves ``(n-1)/n`` of its buffer ``S`` per device around a ring of
  ``n`` members (reduce-scatter, all-gather), twice that for an all-reduce; an
  N-D algorithm does so one dimension after another, each phase on what the
  previous left (``S / n_1`` after the first). Cores of one chip exchange
  through HBM; the links carry what goes between chips.
* Links, counted the same way for every ring: each step a member sends to its
  successor, routed dimension by dimension, the short way around where the slice
  wraps; a ring run both ways round also sends to its predecessor, half the data
  each way. The busiest link direction (how many of the ring's messages cross it)
  sets the ring's bandwidth: on a closed ring both ways halve the time, on a line
  that does not wrap they do not (the way back runs over the same links).
* Latency: each sequential step of a ring waits for its slowest message, one
  ``HOP_LATENCY_S`` per link crossed (the scaling book, part 3 "Sharded Matrices",
  "A note on ICI latency": "each hop over an ICI link has some intrinsic overhead
  regardless of the data volume. This is typically around 1us"; ASTRA-sim's TPU v3
  validation takes "Link Latency is 1 us [as per TPU research team]"). A ring both
  ways round takes ``ceil((n-1)/2)`` steps, one way ``n-1``.

The named assumptions:

  ``optimistic``
      every dimension the group spans at once, both ways round each ring (the
      scaling book's all-gather time ``V / (W_bidi x axes)``); latency overlapped.
  ``bidirectional``
      the compiler's rings (its ring in group order, or its phases), every one of
      them both ways round; latency overlapped.
  ``compiler``
      the compiler's algorithm as libtpu's low-level program runs it
      (:func:`reading`); a ring takes the longer of its transfer and its latency, as
      the scaling book's ``T = max(T_min |X| / 2, V / W)`` has it. The headline.
  ``pessimistic``
      as ``compiler``, with the latency added to the transfer rather than hidden
      behind it, plus ``FIXED_LATENCY_S`` per collective: the book's worked example
      (an all-gather over 3 hops estimated at 3 us, "In practice, it's closer to
      8us") read as a fixed cost on top of the 1 us per hop. The one example cannot
      tell that from 8/3 us per hop, which for a 32-step ring would be 2.7 times
      the latency; no published figure measures a longer ring.

* Collectives inside the loop body run once per step; those outside it once per
  K steps. The step is compute plus collectives (``no_overlap``), or, with
  ``overlap``, the asynchronous ones hidden behind the compute the compiled
  schedule runs while they are in flight (:func:`trainer.analysis.program.window_seconds`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Callable, Sequence

from trainer.analysis import hlo
from trainer.analysis.hlo import Collective
from trainer.parallel import torus
from trainer.parallel.hardware import Accelerator

HOP_LATENCY_S = 1e-6
FIXED_LATENCY_S = 5e-6  # 8 us measured - 3 hops x 1 us, read as a fixed cost
# Where libtpu's 2DAllGatherOnMajorDim sends shards of at least this many bytes half x
# first and half core first, its x links carry 1.5 times the minimum (read in LLO).
_LARGE_SHARD = 8 * 1024
ASSUMPTIONS = ("optimistic", "bidirectional", "compiler", "pessimistic")
COMPILER = "compiler"  # the compiler-literal assumption, the headline figure


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the devices of a compiled program sit.

    Attributes:
      accelerator: the table row of the devices.
      chip_of: per partition id (the program's device order), the chip's
        coordinates relative to the slice.
      shape: chips along each dimension of the slice.
      wraps: per torus dimension, whether the slice closes it into a ring.
      cores_per_chip: devices on each chip.
    """

    accelerator: Accelerator
    chip_of: tuple[tuple[int, ...], ...]
    shape: tuple[int, ...]
    wraps: tuple[bool, ...]
    cores_per_chip: int

    @classmethod
    def from_devices(cls, accelerator: Accelerator, devices: Sequence) -> Topology:
        """From the devices in the program's order (``mesh.devices.flat``).

        Raises:
          ValueError: if the devices do not fill a box of TPU chips.
        """
        slice_ = torus.Torus.of(list(devices))
        if slice_ is None:
            raise ValueError("the devices are not TPU devices filling a box of chips")
        chips = tuple(slice_.chip(d) for d in devices)
        return cls(accelerator, chips, slice_.shape, slice_.wraps, slice_.cores_per_chip)

    def route(self, a: tuple[int, ...], b: tuple[int, ...]) -> list[tuple]:
        """The directed links from chip ``a`` to chip ``b``, dimension by dimension,
        the short way around where the dimension wraps."""
        links, here = [], list(a)
        for d, extent in enumerate(self.shape):
            delta = b[d] - here[d]
            if self.wraps[d] and abs(delta) > extent / 2:
                delta -= int(math.copysign(extent, delta))
            step = 1 if delta > 0 else -1
            for _ in range(abs(delta)):
                links.append((tuple(here), d, step))
                here[d] = (here[d] + step) % extent
        return links


@dataclasses.dataclass(frozen=True)
class Reading:
    """How the back end runs the rings of one collective.

    Attributes:
      both_ways: each ring also runs the other way round, half the data each way.
      steps_of: sequential steps of a ring of ``n`` members.
      bytes_factor: link bytes over the minimum of the ring (1.0 but where read).
      note: where the reading comes from, or the assumption made where there is none.
    """

    both_ways: bool
    steps_of: Callable[[int], int]
    bytes_factor: float = 1.0
    note: str = "read"


def _half(n: int) -> int:
    return math.ceil((n - 1) / 2)


def _all(n: int) -> int:
    return n - 1


def reading(c: Collective) -> Reading:
    """How libtpu 0.0.42.1 runs ``c``, from its emitter and strategy, as its low-level
    program does (the loop trip counts and DMA peers of its LLO dump, README):

    * ``StrategyRing``, ``StrategyND``, ``StrategySubgroupND`` (``colors:1``): every
      ring both ways round, half the shards each way, in ``ceil((n-1)/2)`` steps;
      ``colors`` counts colours of that pincer, not directions;
    * ``UniDirection1DRingStrategy`` / ``UniDirectionNDRingStrategy`` with colours
      >= 2: one-way rings in opposite directions, ``n-1`` steps;
    * ``1DAllGather*``: both neighbours at once, ``ceil((n-1)/2)`` steps;
      ``2DAllGatherOnMajorDim``: a ring over the chips both ways and an exchange
      between a chip's cores; for shards of 8 KiB or more half of each shard goes
      chips-then-core and half core-then-chips, 1.5x the minimum over the links, in
      ``n-2`` rounds.

    Anything else is taken as one one-way ring, and says so in ``note``.
    """
    strategy, emitter = c.algorithm.strategy, c.algorithm.emitter
    if strategy in ("StrategyRing", "StrategyND", "StrategySubgroupND"):
        return Reading(True, _half)
    if strategy.startswith("UniDirection") and c.algorithm.colors >= 2:
        return Reading(True, _all)
    if emitter.startswith("1DAllGather"):
        return Reading(True, _half)
    if emitter == "2DAllGatherOnMajorDim":
        if c.buffer_bytes / max(c.group_size, 1) >= _LARGE_SHARD:
            return Reading(True, lambda n: max(n - 2, 1), 1.5)
        return Reading(True, _half)
    what = emitter or "no emitter"
    return Reading(False, _all, note=f"assumed one one-way ring ({what}: no reading)")


@dataclasses.dataclass(frozen=True)
class _Ring:
    """One phase of a collective: a ring of ``members`` devices whose between-chip
    messages load some link direction at most ``load`` times and are at most
    ``hops`` links long; it moves ``fraction`` of the buffer."""

    members: int
    load: int
    hops: int
    fraction: float


def _ring(
    chips: Sequence[tuple[int, ...]], topo: Topology, fraction: float, both_ways: bool
) -> _Ring:
    """The ring through ``chips`` in this order (a member per device), and, with
    ``both_ways``, the same ring the other way round at the same time."""
    loads: collections.Counter = collections.Counter()
    hops = 0
    orders = (list(chips), list(reversed(chips))) if both_ways else (list(chips),)
    for order in orders:
        for i, here in enumerate(order):
            there = order[(i + 1) % len(order)]
            if here != there:
                route = topo.route(here, there)
                loads.update(route)
                hops = max(hops, len(route))
    return _Ring(len(chips), max(loads.values(), default=0), hops, fraction)


def _phases(
    c: Collective, topo: Topology, chips: list[tuple[int, ...]], both_ways: bool
) -> list[_Ring]:
    """The rings the compiler runs for ``c`` (one after another), each with the
    share of the buffer it moves per member."""
    spanned = [d for d in range(len(topo.shape)) if len({chip[d] for chip in chips}) > 1]
    if c.algorithm.dims <= 1 or len(spanned) <= 1:
        n = len(chips)
        return [_ring(chips, topo, (n - 1) / n, both_ways)]
    phases, remaining, first = [], 1.0, True
    for d in spanned:  # a line of the group along d, the cores of a chip with it first
        line = sorted(
            {chip for chip in chips if all(chip[e] == chips[0][e] for e in spanned if e != d)},
            key=lambda chip: chip[d],
        )
        cores = len(chips) // len(set(chips)) if first else 1
        members = [chip for chip in line for _ in range(cores)]
        n = len(members)
        phases.append(_ring(members, topo, remaining * (n - 1) / n, both_ways))
        remaining /= n
        first = False
    return phases


def collective_seconds(c: Collective, topo: Topology, assumption: str = COMPILER) -> float:
    """Time of one collective on ``topo`` under ``assumption`` (module docstring)."""
    acc = topo.accelerator
    chips = [topo.chip_of[i] for i in c.group]
    distinct = set(chips)
    size = c.buffer_bytes
    if len(distinct) <= 1:  # the cores of one chip: a copy through HBM
        return size / acc.hbm_bandwidth(topo.cores_per_chip) if len(c.group) > 1 else 0.0
    link = acc.ici_link_bandwidth
    # Cores of a chip in other groups of this collective run on the same links.
    link *= (len(c.group) / len(distinct)) / topo.cores_per_chip
    rounds = 2 if c.kind == "all-reduce" else 1  # reduce-scatter, then all-gather
    if c.kind == "collective-permute":
        route = max(
            (len(topo.route(a, b)) for a, b in zip(chips, chips[1:], strict=False)), default=1
        )
        return size / link + route * HOP_LATENCY_S
    if assumption == "optimistic":
        dims = [d for d in range(len(topo.shape)) if len({chip[d] for chip in distinct}) > 1]
        bandwidth = sum(2 * link if topo.wraps[d] else link for d in dims)
        n = len(distinct)
        transfer = rounds * (n - 1) / n * size / bandwidth
        extent = sum(len({chip[d] for chip in distinct}) for d in dims)
        return max(transfer, rounds * extent / 2 * HOP_LATENCY_S)
    how = reading(c)
    if assumption == "bidirectional":
        how = Reading(True, _half)
    ways = 2 if how.both_ways else 1
    seconds = FIXED_LATENCY_S if assumption == "pessimistic" else 0.0
    for ring in _phases(c, topo, chips, how.both_ways):
        if ring.load == 0:  # all on one chip
            continue
        # Each way carries 1/ways of the data; the busiest link direction sets the pace.
        transfer = how.bytes_factor * ring.fraction * size * ring.load / (ways * link)
        latency = how.steps_of(ring.members) * ring.hops * HOP_LATENCY_S
        seconds += rounds * (
            transfer + latency if assumption == "pessimistic" else max(transfer, latency)
        )
    return seconds


def dcn_seconds(t: hlo.DcnTransfer, topo: Topology, assumption: str = COMPILER) -> float:
    """Time of one transfer between slices over the data-center network.

    Each chip sends what its devices put on the DCN (:attr:`hlo.DcnTransfer.wire_bytes`)
    at its DCN bandwidth (:mod:`trainer.parallel.hardware`): the published figure, or
    for a generation without one the high end of the assumed range, and the low end
    under ``pessimistic``. No DCN latency is added: Google publishes none, and the
    transfers here are of megabytes, where bandwidth decides.
    """
    low, high = topo.accelerator.dcn_bandwidth_per_chip
    bandwidth = low if assumption == "pessimistic" else high
    if bandwidth <= 0:
        return 0.0
    return t.wire_bytes * topo.cores_per_chip / bandwidth


@dataclasses.dataclass(frozen=True)
class StepEstimate:
    """The pieces of an estimated step time, in seconds.

    Attributes:
      compute_s: roofline time of the per-device program.
      async_collective_s: collectives issued asynchronously, per step.
      sync_collective_s: the other collectives, per step.
      hidden_s: the part of the asynchronous ones the compiled schedule hides behind
        work it runs while they are in flight (:func:`trainer.analysis.program.window_seconds`).
      dcn_s: transfers between slices over the data-center network, per step.
      overlap_s: ``compute + async - hidden + sync + dcn``.
      no_overlap_s: ``compute + async + sync + dcn``.
    """

    compute_s: float
    async_collective_s: float
    sync_collective_s: float
    hidden_s: float = 0.0
    dcn_s: float = 0.0

    @property
    def overlap_s(self) -> float:
        return self.no_overlap_s - self.hidden_s

    @property
    def no_overlap_s(self) -> float:
        return self.compute_s + self.async_collective_s + self.sync_collective_s + self.dcn_s


def roofline_seconds(
    flops: float, bytes_accessed: float, accelerator: Accelerator, devices_per_chip: int = 1
) -> float:
    """Whole-program roofline of one device with the published peak and bandwidth."""
    return max(
        flops / accelerator.peak_flops(devices_per_chip),
        bytes_accessed / accelerator.hbm_bandwidth(devices_per_chip),
    )


def estimate_step(
    *,
    compute_s: float,
    collectives: Sequence[Collective],
    topo: Topology,
    steps_per_loop: int,
    has_loop: bool,
    assumption: str = COMPILER,
    windows_s: dict[str, float] | None = None,
    dcn: Sequence[hlo.DcnTransfer] = (),
) -> tuple[StepEstimate, list[float]]:
    """The step-time estimate under ``assumption`` and each collective's per-step seconds.

    Args:
      compute_s: per-device compute time of one step (XLA's optimal_seconds).
      collectives: the compiled program's collectives.
      topo: where its devices sit.
      steps_per_loop: K, the steps one call of the program runs.
      has_loop: whether the program has the K-step ``while`` loop (K = 1 unrolls
        it: then everything runs once per step).
      assumption: one of :data:`ASSUMPTIONS`.
      windows_s: per asynchronous collective (by instruction name), the seconds of
        work the schedule runs while it is in flight; what hides it.
      dcn: the program's transfers between slices (:func:`dcn_seconds`).
    """
    seconds, hidden = [], 0.0
    windows_s = windows_s or {}
    for c in collectives:
        per_call = collective_seconds(c, topo, assumption)
        per_step = per_call * c.per_step(steps_per_loop, has_loop)
        seconds.append(per_step)
        if c.is_async:
            window = windows_s.get(c.name, 0.0)
            hidden += min(per_call, window) * (per_step / per_call if per_call else 0.0)
    async_s = math.fsum(s for s, c in zip(seconds, collectives, strict=True) if c.is_async)
    sync_s = math.fsum(s for s, c in zip(seconds, collectives, strict=True) if not c.is_async)
    dcn_s = math.fsum(
        dcn_seconds(t, topo, assumption) * t.per_step(steps_per_loop, has_loop) for t in dcn
    )
    return StepEstimate(compute_s, async_s, sync_s, hidden, dcn_s), seconds
