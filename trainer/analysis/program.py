"""The cost model applied to a program's text alone: any optimized TPU program, ours
or another framework's (MaxText's ``train_compile`` dump), with the same assumptions.

:mod:`trainer.analysis.compiled` reads a program it compiled itself: XLA's cost
analysis of it and of its unrolled twins gives the compute. A program that arrives as
text (``--xla_dump_to`` of another framework's compile: ``*.after_optimizations.txt``)
has neither, so its compute here is a roofline of the program itself, instruction by
instruction, as XLA's ``optimal_seconds`` is: each kernel the schedule runs takes the
longer of its FLOPs at the chip's peak and its HBM bytes at the chip's bandwidth,
times the trips of the loops around it. The same reading applies to our own programs,
so that two programs are compared under one model:

* FLOPs: a kernel's matmuls (:func:`trainer.analysis.flops.matmul_flops`) and attention
  kernels (:func:`trainer.analysis.flops.attention_kernels`, counted from their shapes
  whatever they state); elementwise work is left out (a floor).
* Bytes: a kernel's operands and result, where a kernel reading a slice of a stacked
  operand (``dynamic-slice``: a layer of a scan's stack) counts the slice, and one
  writing a slice in place (``dynamic-update-slice``) the update.
* The network: every collective (:func:`trainer.analysis.hlo.collectives`, one per
  async chain), timed by :mod:`trainer.analysis.costmodel` on the devices the program
  runs on, its partition ids taken in the order of :func:`trainer.parallel.mesh.make_mesh`
  (physical order: as our programs lay them out; another framework's may differ).

HBM: XLA's memory-usage report of the dump (``*-memory-usage-report.txt``: the peak of
its heap, and the largest buffers live at that peak) when there is one.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from trainer.analysis import costmodel, flops, hlo
from trainer.parallel.hardware import Accelerator

# Instructions that name or view buffers, or hand work to computations costed apart.
_FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
    "while",
    "conditional",
    "call",
    "opt-barrier",
    "send",
    "recv",
    "send-done",
    "recv-done",
}
_NETWORK = {*hlo.KINDS, *hlo.ASYNC_KINDS}  # timed by the network model instead


@dataclasses.dataclass(frozen=True)
class Roofline:
    """A program's compute, per run of it.

    Attributes:
      seconds: the sum over its kernels of max(FLOPs / peak, bytes / bandwidth),
        each times its trips.
      flops: matmul and attention FLOPs.
      bytes: HBM bytes its kernels read and write.
      kernels: kernels the schedule runs (with their trips).
    """

    seconds: float
    flops: float
    bytes: float
    kernels: int


def _scheduled(bodies: dict[str, list[str]], entry: str) -> set[str]:
    """The computations that run as schedules of their own: the entry, loop bodies and
    conditions, conditional branches and called computations, transitively."""
    found, stack = set(), [entry]
    while stack:
        name = stack.pop()
        if name in found or name not in bodies:
            continue
        found.add(name)
        for line in bodies[name]:
            ins = hlo.instruction(line)
            if ins is None or ins.opcode not in ("while", "conditional", "call"):
                continue
            for key in ("body", "condition", "to_apply"):
                if m := re.search(rf"{key}=%?([\w.\-]+)", line):
                    stack.append(m.group(1))
            if m := re.search(r"branch_computations=\{([^}]*)\}", line):
                stack.extend(c.strip().lstrip("%") for c in m.group(1).split(","))
    return found


def _entry(hlo_text: str) -> str:
    match = re.search(r"^ENTRY\s+%?([\w.\-]+)", hlo_text, re.MULTILINE)
    return match.group(1) if match else ""


def _fused_flops(name: str, bodies: dict[str, list[str]], seen: frozenset = frozenset()) -> float:
    """Matmul FLOPs of a fused computation, nested fusions included."""
    lines = bodies.get(name, [])
    types = {ins.name: ins.type_text for ins in map(hlo.instruction, lines) if ins}
    count = sum(flops.matmul_flops(line, types) for line in lines)
    for line in lines:
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called and called.group(1) not in seen:
            count += _fused_flops(called.group(1), bodies, seen | {name})
    return count


def _reads(name: str, bodies: dict[str, list[str]], seen: frozenset = frozenset()) -> dict:
    """Per parameter number of fused computation ``name``: the bytes it reads of that
    operand where it reads only slices of it (``dynamic-slice``, here or in a nested
    fusion) or updates it in place (``dynamic-update-slice``: the update's bytes,
    marked ``("in place", bytes)``); parameters read whole are left out."""
    inner = [i for i in map(hlo.instruction, bodies.get(name, [])) if i]
    types = {i.name: i.type_text for i in inner}
    params = {
        i.name: int(re.match(r"(\d+)", i.rest).group(1)) for i in inner if i.opcode == "parameter"
    }
    read: dict[str, list] = {p: [] for p in params}  # parameter -> bytes of each use
    for i in inner:
        refs = hlo.operands(i.rest)
        called = re.search(r"calls=%?([\w.\-]+)", i.rest)
        nested = (
            _reads(called.group(1), bodies, seen | {name})
            if called and called.group(1) not in seen
            else {}
        )
        for position, ref in enumerate(refs):
            if ref not in read:
                continue
            if i.opcode == "dynamic-slice" and position == 0:
                read[ref].append(hlo.shape_bytes(i.type_text))
            elif i.opcode == "dynamic-update-slice" and position == 0:
                read[ref].append(("in place", hlo.operand_bytes(refs[1], types)))
            elif called and position in nested:
                read[ref].append(nested[position])
            else:
                read[ref].append(None)
    out = {}
    for param, uses in read.items():
        if uses and all(u is not None for u in uses):
            in_place = [u[1] for u in uses if isinstance(u, tuple)]
            out[params[param]] = (
                ("in place", sum(in_place)) if in_place else sum(u for u in uses if u)
            )
    return out


def _fused_bytes(line: str, called: str, bodies: dict[str, list[str]], types: dict) -> int:
    """HBM bytes a kernel moves: its operands and result, where the fused computation
    reads only slices of an operand or updates one in place, those slices
    (:func:`_reads`)."""
    ins = hlo.instruction(line)
    refs = hlo.operands(ins.rest)
    reads = _reads(called, bodies)
    moved = hlo.shape_bytes(ins.type_text)
    for number, ref in enumerate(refs):
        whole = hlo.operand_bytes(ref, types)
        got = reads.get(number)
        if isinstance(got, tuple):  # updated in place: in the result too, only the update
            moved += 2 * got[1] - whole
        else:
            moved += whole if got is None else got
    return max(moved, 0)


class Kernel(NamedTuple):
    """One kernel the schedule runs: where, what, and what it costs a run."""

    computation: str
    name: str
    line: str
    flops: float
    bytes: float
    trips: int


def kernels(hlo_text: str) -> list[Kernel]:
    """Every kernel of the program's schedules with its FLOPs and HBM bytes (module
    docstring), in schedule order: no bookkeeping, no collectives (the network model
    times those), an async pair costed at its start."""
    bodies = hlo.computations(hlo_text)
    where = hlo.loops(bodies)
    found = []
    for name in _scheduled(bodies, _entry(hlo_text)):
        lines = bodies[name]
        types = {ins.name: ins.type_text for ins in map(hlo.instruction, lines) if ins}
        for line in lines:
            ins = hlo.instruction(line)
            if ins is None or ins.opcode in _FREE or ins.opcode in _NETWORK:
                continue
            if ins.opcode.endswith("-done") or ins.name.startswith(hlo.CHAIN_ENDS):
                continue  # an async pair is costed at its start; a chain by the network
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if called and "ReduceScatter" in hlo.Algorithm.of(line).emitter:
                continue  # an all-reduce fused with its slice: a network reduce-scatter
            if called:
                f = _fused_flops(called.group(1), bodies) + _attention(line)
                b = _fused_bytes(line, called.group(1), bodies, types)
            else:
                f = flops.matmul_flops(line, types) + _attention(line)
                b = hlo.shape_bytes(ins.type_text) + sum(
                    hlo.operand_bytes(ref, types) for ref in hlo.operands(ins.rest)
                )
            found.append(Kernel(name, ins.name, line, f, b, where.trips.get(name, 1)))
    return found


def kernel_seconds(kernel: Kernel, accelerator: Accelerator, devices_per_chip: int = 1) -> float:
    """One run of ``kernel``: the longer of its FLOPs at peak and its bytes at bandwidth."""
    return costmodel.roofline_seconds(kernel.flops, kernel.bytes, accelerator, devices_per_chip)


def roofline(
    hlo_text: str,
    accelerator: Accelerator,
    devices_per_chip: int = 1,
    select: Callable[[str], bool] | None = None,
) -> Roofline:
    """The compute of one run of the program ``hlo_text`` (module docstring), or of
    the kernels whose instruction line ``select`` accepts."""
    chosen = [k for k in kernels(hlo_text) if select is None or select(k.line)]
    return Roofline(
        sum(k.trips * kernel_seconds(k, accelerator, devices_per_chip) for k in chosen),
        sum(k.trips * k.flops for k in chosen),
        sum(k.trips * k.bytes for k in chosen),
        sum(k.trips for k in chosen),
    )


def window_seconds(
    hlo_text: str,
    collectives: Sequence[hlo.Collective],
    accelerator: Accelerator,
    devices_per_chip: int = 1,
) -> dict[str, float]:
    """For each asynchronous collective (by name), the seconds of the work the schedule
    runs while it is in flight (module docstring): the kernels it is
    fused into, or those between its start and its done, each timed by its roofline
    (:func:`kernel_seconds`). A fused gather's kernels are matmuls: their FLOPs, not
    their bytes, set how long they run, and so how much of the gather they hide."""
    found = kernels(hlo_text)
    by_name = {k.name: k for k in found}
    order = collections.defaultdict(list)  # computation -> its kernels' names, in order
    for k in found:
        order[k.computation].append(k.name)
    bodies = hlo.computations(hlo_text)
    out = {}
    for c in collectives:
        if not c.is_async:
            continue
        if c.fused_with:
            inside = [n for n in c.fused_with if n in by_name]
        else:  # the kernels between the -start and the -done that takes it
            names = [hlo.instruction_name(line) for line in bodies.get(c.computation, [])]
            done = next(
                (
                    i
                    for i, line in enumerate(bodies.get(c.computation, []))
                    if re.search(rf"-done\(.*%{re.escape(c.name)}(?![\w.\-])", line)
                ),
                len(names),
            )
            first = names.index(c.name) if c.name in names else done
            between = set(names[first + 1 : done])
            inside = [n for n in order[c.computation] if n in between]
        out[c.name] = sum(kernel_seconds(by_name[n], accelerator, devices_per_chip) for n in inside)
    return out


def outside_the_passes(line: str) -> bool:
    """Whether an instruction belongs to neither the forward nor the backward pass: its
    JAX ``op_name`` is a path with no ``jvp(`` in it (``jvp()`` forward,
    ``transpose(jvp())`` backward), as in the optimizer's update (moments, norms,
    trust ratios, the new weights) and the loss's bookkeeping."""
    name = re.search(r'op_name="([^"]*)"', line)
    # A JAX operation's name is its path ("jit(train_loop)/while/body/..."); one the
    # compiler made (a zero-filled "broadcast.5585") names no place in the step.
    return name is not None and "/" in name.group(1) and "jvp(" not in name.group(1)


def _attention(line: str) -> float:
    found = flops.attention_kernel(line)
    return found[0] if found else 0.0


@dataclasses.dataclass(frozen=True)
class Buffer:
    """One allocation of XLA's memory-usage report, live at the heap's peak.

    Attributes:
      bytes: its size.
      values: how many values share it over the program.
      shapes: the shapes of those values, as the report lists them.
    """

    bytes: int
    values: int
    shapes: str


def memory_report(text: str) -> tuple[int, list[Buffer]]:
    """``(peak heap bytes, its buffers, largest first)`` from XLA's
    ``*-memory-usage-report.txt`` (its default memory space: HBM on a TPU)."""
    total = re.search(r"Total bytes: (\d+)", text)
    rows = re.findall(
        r"^\s*[\d.]+\w+\(\s*\d+%\);\s*([\d.]+)(\w+);\s*\d+;\s*(\d+);\s*(.*)$", text, re.MULTILINE
    )
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    buffers = [
        Buffer(int(float(size) * units[unit]), int(n), shapes.strip())
        for size, unit, n, shapes in rows
    ]
    return (int(total.group(1)) if total else 0), sorted(buffers, key=lambda b: -b.bytes)


def peak_buffers(live_range: str) -> tuple[int, list[tuple[str, int]]]:
    """``(bytes live at the peak, [(what holds each buffer, its bytes)], largest
    first)`` from XLA's ``*-live-range.txt`` dump: its "Stack trace breakdown for peak
    usage", whose leaves name the JAX operation (``op_name``) or instruction that
    defined each buffer live at the schedule's peak."""
    total = re.search(r"Stack trace breakdown for peak usage: ([\d ]+) bytes", live_range)
    leaves = [
        (name.strip(), int(current.replace(" ", "")))
        for name, current in re.findall(
            r"[├└]── (.+?) \([\d.]+%, total: [\d ]+ bytes, current: ([\d ]+) bytes", live_range
        )
        if int(current.replace(" ", ""))
    ]
    size = int(total.group(1).replace(" ", "")) if total else 0
    return size, sorted(leaves, key=lambda leaf: -leaf[1])


def analyze_program(
    hlo_text: str,
    devices: list,
    accelerator: Accelerator,
    *,
    steps_per_run: int = 1,
    memory_usage_report: str | None = None,
    live_range: str | None = None,
) -> dict:
    """The step of a program known only by its optimized HLO text, on ``devices``.

    Args:
      hlo_text: the optimized program (``*.after_optimizations.txt``).
      devices: the devices it runs on, in its partition order (module docstring).
      accelerator: their table row.
      steps_per_run: training steps one run of it takes (a K-step loop: K).
      memory_usage_report: XLA's report of its buffers, if dumped.
      live_range: XLA's live ranges of its buffers, if dumped (:func:`peak_buffers`).

    Returns:
      Per step: ``compute`` (:func:`roofline`), ``collectives`` (counts and bytes by
      kind and dtype, one per async chain), ``est_step_time_s`` under every
      assumption, XLA's heap (``hbm_heap_bytes``, ``largest_allocations``) and
      what is live at its peak (``live_at_peak``).
    """
    topo = costmodel.Topology.from_devices(accelerator, devices)
    cores = topo.cores_per_chip
    compute = roofline(hlo_text, accelerator, cores)
    found = hlo.collectives(hlo_text, len(devices))
    has_loop = steps_per_run > 1
    windows = window_seconds(hlo_text, found, accelerator, cores)
    per_step = 1 / steps_per_run
    estimates = {}
    for assumption in costmodel.ASSUMPTIONS:
        estimate, _ = costmodel.estimate_step(
            compute_s=compute.seconds * per_step,
            collectives=found,
            topo=topo,
            steps_per_loop=steps_per_run,
            has_loop=has_loop,
            assumption=assumption,
            windows_s=windows,
        )
        estimates[assumption] = {
            "overlap": estimate.overlap_s,
            "no_overlap": estimate.no_overlap_s,
            "collectives": estimate.async_collective_s + estimate.sync_collective_s,
            "hidden": estimate.hidden_s,
        }
    kinds: dict[str, dict] = {}
    for c in found:
        row = kinds.setdefault(f"{c.kind} {c.dtype}", {"count": 0.0, "bytes": 0.0, "async": 0.0})
        times = c.per_step(steps_per_run, has_loop)
        row["count"] += times
        row["bytes"] += times * c.buffer_bytes
        row["async"] += times * c.is_async
    heap, buffers = memory_report(memory_usage_report) if memory_usage_report else (0, [])
    peak, live = peak_buffers(live_range) if live_range else (0, [])
    return {
        "num_devices": len(devices),
        "device_kind": devices[0].device_kind,
        "steps_per_run": steps_per_run,
        "compute_s": compute.seconds * per_step,
        "flops_per_step": compute.flops * per_step,
        "bytes_per_step": compute.bytes * per_step,
        "dot_flops_per_step": flops.dot_flops(hlo_text) * per_step,
        "attention_flops_per_step": per_step
        * sum(f * trips for f, _, trips in flops.attention_kernels(hlo_text)),
        "collectives": kinds,
        "est_step_time_s": estimates,
        # XLA's heap (the memory-usage report), and what is live at its peak.
        "hbm_heap_bytes": heap,
        "largest_allocations": [dataclasses.asdict(b) for b in buffers[:12]],
        "live_at_peak_bytes": peak,
        "live_at_peak": live[:16],
        "loops_unread": list(hlo.loops(hlo.computations(hlo_text)).unread),
        "peak_flops": accelerator.peak_flops(cores),
    }
