"""Reading collectives out of HLO text.

On CPU, read the module right after the SPMD partitioner: the CPU backend later
promotes bf16 collectives to f32 and rewrites reduce-scatter as all-reduce +
slice, so its compiled program does not show what a TPU or GPU would run. It is
dumped during compilation (:func:`compile_with_dump`) and parsed here.

For a TPU target the compiled program itself is parsed (``compiled.as_text()``):
it is what the TPU runs, with the back end's own rewrites (see
``trainer/aot.py``), its async ``-start``/``-done`` pairs and, in each op's
``backend_config``, the collective emitter it chose.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re
import tempfile
from typing import NamedTuple

import jax
import numpy as np

_DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "f64": 8,
    "s64": 8,
    "u64": 8,
}
# The collectives' HLO opcodes, and their async starts -> the opcode.
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
ASYNC_KINDS = {f"{k}-start": k for k in KINDS}
_EMITTER = re.compile(r'"emitter":"(\w+)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_CALLED = re.compile(
    r"(?:body|condition|calls|to_apply|branch_computations)=\{?([^,}\s]+(?:,\s*%[^,}\s]+)*)"
)


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """How the TPU back end runs a collective, from its ``backend_config``.

    ``collective_algorithm_config`` names an emitter (``RotatedPincerEmitter``,
    ``SingleInputAllReduceScatterFusion``, ``2DAllGatherOnMajorDim``, ...), for most a
    strategy (``StrategyRing``, ``StrategyND``, ``UniDirection1DRingStrategy``, ...)
    and its parameters, as printed (libtpu documents none of them): ``colors``,
    ``phases`` (the torus dimensions an N-D algorithm runs along one after another)
    and ``dims`` (1 for a ring through the whole group in its order, N for an
    algorithm along N dimensions). What they mean on the links - a
    ``StrategyRing{colors:1}`` is a ring run both ways round, not one way - was read
    from libtpu's low-level program: :func:`trainer.analysis.costmodel.reading`.

    Attributes:
      emitter: the emitter's name ("" where the back end says nothing, e.g. on CPU).
      strategy: the strategy's name, if any.
      colors: the strategy's colours, as printed (1 where none is printed).
      phases: dimensions run one after another.
      dims: 1 (a ring in group order) or the dimensions the algorithm spans.
    """

    emitter: str = ""
    strategy: str = ""
    colors: int = 1
    phases: int = 1
    dims: int = 1

    @classmethod
    def of(cls, line: str) -> Algorithm:
        """The algorithm of a collective's (or its fusion's) HLO line."""
        emitter = _EMITTER.search(line)
        if emitter is None:
            return cls()
        strategy = re.search(r'"strategy":"(\w+)"', line)
        debug = re.search(r'"debug":"\\n(\w+)\{([^}]*)', line)
        fields = dict(re.findall(r"(\w+):(\d+)", debug.group(2))) if debug else {}
        colors, phases = int(fields.get("colors", 1)), int(fields.get("phases", 1))
        named = re.match(r"(\d)D", emitter.group(1))  # 2DAllGatherOnMajorDim
        typed = re.search(r"Type: (\d)D", line)  # a reduce-scatter fusion's own type
        dims = int(named.group(1)) if named else int(typed.group(1)) if typed else phases
        return cls(emitter.group(1), strategy.group(1) if strategy else "", colors, phases, dims)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the partitioned module.

    Attributes:
      kind: ``all-reduce``, ``reduce-scatter``, ``all-gather``, ...
      dtype: element type, e.g. ``bf16``.
      result_bytes: bytes of the per-device result.
      group_size: devices in each replica group.
      in_loop: whether it runs inside a ``while`` body (once per step).
      is_async: issued as a ``-start``/``-done`` pair (may overlap compute).
      emitter: the back end's collective emitter (TPU ``backend_config``).
      group: the partition ids of the first replica group, in ring order.
      algorithm: how the back end runs it (:class:`Algorithm`).
      loop_depth: how many ``while`` bodies enclose it.
      trips: how many times it runs per run of the program (the product of the trip
        counts of the loops around it: K for the K-step loop, times a stack's layers
        for a layer scan inside it).
      name: its instruction's name (of the ``-start`` of an async pair).
      computation: the computation that holds that instruction.
      fused_with: for a collective fused with compute (XLA's async collective fusion:
        ``async_collective_fusion`` kernels), the instructions that run those kernels,
        in schedule order; it overlaps their own work.
      chain: the ``chain_id`` the pieces of such a collective share ("" for others).
    """

    kind: str
    dtype: str
    result_bytes: int
    group_size: int
    in_loop: bool
    is_async: bool = False
    emitter: str = ""
    group: tuple[int, ...] = ()
    loop_depth: int = 0
    trips: int = 1
    algorithm: Algorithm = Algorithm()
    name: str = ""
    computation: str = ""
    fused_with: tuple[str, ...] = ()
    chain: str = ""

    def per_step(self, steps_per_loop: int, has_loop: bool) -> float:
        """How many times it runs per training step, in a program of ``steps_per_loop``
        steps (in a K-step loop if ``has_loop``: K trips of it are K steps)."""
        return self.trips / (steps_per_loop if has_loop else 1)

    @property
    def buffer_bytes(self) -> int:
        """Per-device bytes of the whole buffer the collective works on: the
        all-reduced array, the gathered result, the scattered input."""
        if self.kind == "reduce-scatter":
            return self.result_bytes * self.group_size
        return self.result_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each device sends with a ring algorithm: (n-1)/n of the data for
        reduce-scatter (of its input) and all-gather (of its output), twice
        that for all-reduce."""
        n = self.group_size
        if n <= 1:
            return 0.0
        frac = (n - 1) / n
        if self.kind == "all-reduce":
            return 2 * frac * self.result_bytes
        if self.kind == "reduce-scatter":
            return frac * self.result_bytes * n  # the input is n results
        return frac * self.result_bytes


def compile_with_dump(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, str]:
    """Compiles ``lowered`` and returns it with its post-SPMD-partitioning HLO text.

    Needs the persistent compilation cache off (``jax_enable_compilation_cache``):
    JAX leaves the dump options out of the cache key, so a hit would compile, and
    dump, nothing. Turning it off is the caller's (a command's set-up, a test's
    fixture): it is process-wide.

    Raises:
      RuntimeError: if XLA dumped nothing (a cache hit, most likely).
    """
    with tempfile.TemporaryDirectory() as tmp:
        compiled = lowered.compile(
            compiler_options={
                "xla_dump_to": tmp,
                "xla_dump_hlo_pass_re": "spmd-partitioning",
                "xla_dump_hlo_as_text": True,
            }
        )
        files = sorted(glob.glob(os.path.join(tmp, "*after_spmd-partitioning*.txt")))
        if not files:
            cache = jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir
            raise RuntimeError(
                "XLA wrote no after_spmd-partitioning dump"
                + (
                    f": the program came from the persistent compilation cache ({cache}); "
                    "set jax_enable_compilation_cache to False before compiling"
                    if cache
                    else ""
                )
            )
        with open(files[-1]) as f:
            return compiled, f.read()


def _iota(dims: list[int], perm: list[int] | None) -> np.ndarray:
    ids = np.arange(math.prod(dims)).reshape(dims)
    return ids.transpose(perm) if perm else ids


def ints(text: str | None) -> list[int]:
    """The integers of a comma-separated list (``"4,256"`` -> [4, 256]; [] for none)."""
    return [int(i) for i in text.split(",") if i.strip()] if text else []


def _mesh_groups(sizes: dict[str, int], device_ids: np.ndarray | None, axes: list[str]):
    """The groups of libtpu's mesh form: ``mesh['a'=2,'b'=4][, device_ids=(...)] {'a'}``.

    Device ids laid out on the named axes (row-major, or ``device_ids``); an axis
    reference ``'b':(pre)size`` is the middle factor of axis b split into ``[pre,
    size, rest]``; the grouped axes go last, in the order written, and each run of
    their product is a group.
    """
    ids = np.arange(math.prod(sizes.values())) if device_ids is None else device_ids
    refs = []  # (axis, pre, size) of every axis reference
    for ref in axes:
        match = re.fullmatch(r"'(\w+)'(?::\((\d+)\)(\d+))?", ref.strip())
        name = match.group(1)
        pre, size = (int(match.group(2)), int(match.group(3))) if match.group(2) else (1, None)
        refs.append((name, pre, sizes[name] if size is None else size))
    factors = []  # (label, size) of every dim after splitting the referenced axes
    for name, total in sizes.items():
        done = 1
        for _, pre, size in sorted((r for r in refs if r[0] == name), key=lambda r: r[1]):
            if pre > done:
                factors.append(((name, "pad", done), pre // done))
            factors.append(((name, pre), size))
            done = pre * size
        if total > done or done == 1:
            factors.append(((name, "rest", done), total // done))
    ids = ids.reshape([size for _, size in factors])
    labels = [label for label, _ in factors]
    grouped = [labels.index((name, pre)) for name, pre, _ in refs]
    order = [i for i in range(len(labels)) if i not in grouped] + grouped
    size = math.prod(ids.shape[i] for i in grouped)
    return ids.transpose(order).reshape(-1, size)


def replica_groups(line: str, num_devices: int) -> np.ndarray:
    """Every replica group of a collective's HLO line, ``[groups, size]`` partition ids
    (positions in the program's device assignment), in ring order.

    The three forms libtpu prints: explicit ``{{0,1},{2,3}}`` (``shard_map``'s
    collectives), iota ``[2,4]<=[4,2]T(1,0)``, and the mesh form
    ``mesh['axis_0'=4,'axis_1'=8], device_ids=([4,8]T(1,0)) {'axis_0'}`` (the
    partitioner's). No groups, or ``{}``, means one group of all devices.
    """
    match = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if match and match.group(1):
        groups = [ints(g) for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
        return np.asarray(groups)
    match = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if match:
        shape = ints(match.group(1))
        return _iota(ints(match.group(2)), ints(match.group(3)) or None).reshape(shape)
    match = re.search(
        r"replica_groups=mesh\[([^\]]*)\]"
        r"(?:,\s*device_ids=\((?:\[([\d,]+)\](?:T\(([\d,]+)\))?|([\d,\s]+))\))?"
        r"\s*\{([^}]*)\}",
        line,
    )
    if match:
        sizes = {name: int(n) for name, n in re.findall(r"'(\w+)'=(\d+)", match.group(1))}
        device_ids = None
        if match.group(2):
            device_ids = _iota(ints(match.group(2)), ints(match.group(3)) or None)
        elif match.group(4):
            device_ids = np.asarray(ints(match.group(4)))
        return _mesh_groups(sizes, device_ids, [a for a in match.group(5).split(",") if a])
    return np.arange(num_devices).reshape(1, -1)


def first_replica_group(line: str, num_devices: int) -> tuple[int, ...]:
    """Partition ids of the first replica group (see :func:`replica_groups`)."""
    return tuple(int(i) for i in replica_groups(line, num_devices)[0])


def computations(hlo_text: str) -> dict[str, list[str]]:
    """``{computation name: its instruction lines, in order}`` of an HLO module. In a
    scheduled module (a TPU's optimized program) the order is the order they run."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and "=" not in line.split("{")[0].split("(")[0]:
            current = match.group(1)
            bodies[current] = []
        elif current is not None and line.strip() and line.strip() != "}":
            bodies[current].append(line)
    return bodies


class Instruction(NamedTuple):
    """One HLO instruction line: its name, result type text, opcode and the rest."""

    name: str
    type_text: str
    opcode: str
    rest: str


def instruction(line: str) -> Instruction | None:
    """The parts of an HLO instruction line, or None for anything else."""
    match = _INSTRUCTION.match(line)
    if match is None:
        return None
    return Instruction(instruction_name(line), match.group(1), match.group(2), match.group(3))


def instruction_name(line: str) -> str:
    """The name an HLO instruction line defines (``%fusion.3 = ...`` -> ``fusion.3``)."""
    match = re.match(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=", line)
    return match.group(1) if match else ""


def dims(type_text: str) -> list[int]:
    """The dimensions of the first array an HLO type names (``bf16[4,256]{1,0}`` -> [4, 256])."""
    shape = _SHAPE.search(type_text)
    return ints(shape.group(2)) if shape else []


def shape_bytes(type_text: str) -> int:
    """Bytes of the arrays an HLO type (``f32[8,128]{1,0}``, or a tuple of them) names."""
    return sum(
        _DTYPE_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _SHAPE.findall(type_text)
    )


def tuple_elements(type_text: str) -> list[str]:
    """The element types of a tuple type (``(bf16[2]{0}, (f32[], s32[]))`` -> two), or
    ``[type_text]`` for an array."""
    text = re.sub(r"/\*.*?\*/", "", type_text.strip())
    if not text.startswith("("):
        return [text]
    elements, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                elements.append(text[start:i])
        elif ch == "," and depth == 1:
            elements.append(text[start:i])
            start = i + 1
    return [e.strip() for e in elements if e.strip()]


def operands(rest: str) -> list[str]:
    """The operand references of an instruction (:class:`Instruction`'s ``rest``):
    names, or ``name#i`` for element i of a tuple-shaped one (as libtpu 0.0.52 prints
    a loop state's elements)."""
    return re.findall(r"%([\w.\-]+(?:#\d+)?)", rest.split(")", 1)[0])


def operand_bytes(ref: str, types: dict[str, str]) -> int:
    """Bytes of operand ``ref`` (:func:`operands`), ``types`` the result type text of
    each instruction of its computation by name."""
    name, _, index = ref.partition("#")
    type_text = types.get(name, "")
    if index:
        elements = tuple_elements(type_text)
        type_text = elements[int(index)] if int(index) < len(elements) else ""
    return shape_bytes(type_text)


@dataclasses.dataclass(frozen=True)
class Loops:
    """Where each computation of a module runs, in ``while`` loops.

    Attributes:
      depth: computation -> how many ``while`` bodies enclose it: 1 in the K-step
        loop, 2 in a loop nested inside it (over micro-batches, over a stack of layers).
      trips: computation -> how many times it runs per run of the module: the
        product of the trip counts of the loops around it.
      unread: the loops (their ``while`` instruction) whose trip count the program
        does not say; each is taken as 1 trip.
    """

    depth: collections.Counter[str]
    trips: dict[str, int]
    unread: tuple[str, ...] = ()


def trip_count(line: str, bodies: dict[str, list[str]]) -> int | None:
    """The trip count of the ``while`` instruction on ``line``: its ``known_trip_count``
    (XLA prints it in an optimized program's ``backend_config``), else read from its
    condition and body, where a counter from 0 is compared ``counter < N``
    (``compare(..., constant(N)), direction=LT``: the only integer constant there) and
    the body adds a constant step to it: 1 in a scan (s32); 2 in the TPU partitioner's
    windowed einsum loops (u32), each trip of which computes two of the matmul's
    blocks. That the counter starts at 0 is assumed (the while's operand is a copy)."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
    if known:
        return int(known.group(1))
    condition = re.search(r"condition=%?([\w.\-]+)", line)
    cond = _by_name(bodies.get(condition.group(1), []) if condition else [])
    constants = [v for v in map(_int_constant, cond.values()) if v is not None]
    compares = [c for c in cond.values() if c.opcode == "compare" and "direction=LT" in c.rest]
    if len(set(constants)) != 1 or len(compares) != 1:
        return None
    # The counter: the tuple element the compare reads.
    read = cond.get(next(iter(operands(compares[0].rest)), ""))
    index = re.search(r"index=(\d+)", read.rest) if read else None
    body = re.search(r"body=%?([\w.\-]+)", line)
    step = _counter_step(bodies.get(body.group(1), []) if body else [], index and int(index[1]))
    return -(-constants[0] // step)


def _by_name(lines: list[str]) -> dict[str, Instruction]:
    """A computation's instructions (:func:`computations`) by name."""
    return {i.name: i for i in map(instruction, lines) if i}


def _int_constant(ins: Instruction | None) -> int | None:
    """The value of a scalar s32 or u32 ``constant``; None for anything else."""
    if ins is None or ins.opcode != "constant" or not re.match(r"[su]32\[\]", ins.type_text):
        return None
    return int(ins.rest.split(")", 1)[0])


def _counter_step(lines: list[str], counter: int | None) -> int:
    """What a loop body adds to its counter (tuple element ``counter``) each trip: the
    constant of the ``add`` its root tuple returns there (1 where it is no such add)."""
    root = next((instruction(t) for t in lines if t.lstrip().startswith("ROOT")), None)
    if counter is None or root is None or root.opcode != "tuple":
        return 1
    returned = operands(root.rest)
    found = _by_name(lines)
    add = found.get(returned[counter]) if counter < len(returned) else None
    if add is None or add.opcode != "add":
        return 1
    steps = [_int_constant(found.get(ref)) for ref in operands(add.rest)]
    return next((v for v in steps if v), 1)


def loops(bodies: dict[str, list[str]]) -> Loops:
    """The loops of a module (:func:`computations`) and what runs inside them."""
    calls = {
        name: {
            c.strip().lstrip("%")
            for m in _CALLED.finditer("\n".join(lines))
            for c in m.group(1).split(",")
        }
        for name, lines in bodies.items()
    }
    found = []  # (body, trips, while instruction)
    for lines in bodies.values():
        for line in lines:
            body = re.search(r"body=%?([\w.\-]+)", line) if " while(" in line else None
            if body:
                found.append((body.group(1), trip_count(line, bodies), instruction_name(line)))

    def reachable(body: str) -> set[str]:
        seen, stack = set(), [body]
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(calls.get(name, ()))
        return seen

    depth: collections.Counter[str] = collections.Counter()
    trips = dict.fromkeys(bodies, 1)
    for body, count, _ in found:
        for name in reachable(body):
            depth[name] += 1
            trips[name] = trips.get(name, 1) * (count or 1)
    return Loops(depth, trips, tuple(name for _, count, name in found if count is None))


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """All collectives of a partitioned HLO module, marked in-loop or not.

    XLA's async collective fusion (``xla_tpu_enable_async_collective_fusion*``) splits
    one collective into pieces that each hold a copy of it: a start fusion
    (``async-collective-start``), one or more ``async_collective_fusion`` kernels that
    run a step of it beside compute (several under ``..._multiple_steps``), and a done
    fusion. libtpu 0.0.52 tags the pieces of one transfer with one ``chain_id`` (in
    ``frontend_attributes``): they are one collective here, asynchronous, fused with
    its kernels, at the place and with the trips of the computation that runs them.
    Pieces without a ``chain_id`` are read as before: the start and done fusions as
    bookkeeping, each kernel a transfer of its own.
    """
    bodies = computations(hlo_text)
    where = loops(bodies)
    # A TPU back end may fuse all-reduce + dynamic-slice into one kCustom fusion that
    # runs as a true reduce-scatter; its emitter sits on the fusion, not the all-reduce.
    fused_scatter = {
        m.group(1): Algorithm.of(line)
        for lines in bodies.values()
        for line in lines
        if "kind=kCustom" in line and "ReduceScatter" in Algorithm.of(line).emitter
        for m in [re.search(r"calls=%?([\w.\-]+)", line)]
        if m
    }
    caller = {}  # fused computation -> (the computation calling it, the calling instruction)
    for name, lines in bodies.items():
        for line in lines:
            called = re.search(r"calls=%?([\w.\-]+)", line)
            if called:
                caller[called.group(1)] = (name, instruction_name(line))
    found, chains = [], collections.defaultdict(set)
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match or (match.group(2) not in KINDS and match.group(2) not in ASYNC_KINDS):
                continue
            host, piece = caller.get(name, ("", ""))
            chain = re.search(r'chain_id="(\w+)"', line)
            if chain and host:
                key = (host, chain.group(1))
                chains[key].add(piece)
                if len(chains[key]) > 1:
                    continue  # a later piece of a chain already found
            elif piece.startswith(CHAIN_ENDS):
                continue  # libtpu 0.0.42.1: a start or done fusion, its kernel's bookkeeping
            found.append(_collective(line, match, name, where, num_devices, fused_scatter))
    out = []
    for c in found:
        host, piece = caller.get(c.computation, ("", ""))
        if c.chain and host:
            # Each chain once, fused with its kernels in the order the schedule runs them.
            pieces = chains[(host, c.chain)]
            kernels = tuple(
                k
                for k in map(instruction_name, bodies[host])
                if k in pieces and not k.startswith(CHAIN_ENDS)
            )
            c = dataclasses.replace(c, is_async=True, fused_with=kernels)
        elif c.computation.startswith("async_collective_fusion") and host:
            c = dataclasses.replace(c, is_async=True, fused_with=(piece,))
        out.append(c)
    return out


# The instructions that open and close an async collective fusion's chain.
# The start and done fusions of an async chain (the kernels between run its steps).
CHAIN_ENDS = ("async-collective-start", "async-collective-done")


def _collective(line, match, name, where, num_devices, fused_scatter) -> Collective:
    """The :class:`Collective` of one collective instruction ``line`` in computation ``name``."""
    shapes = _SHAPE.findall(match.group(1))
    is_async = match.group(2) in ASYNC_KINDS
    if is_async and match.group(1).startswith("(") and len(shapes) > 1:
        # A -start returns (operands, results[, scratch]): keep the results.
        shapes = shapes[len(shapes) // 2 :] if len(shapes) % 2 == 0 else shapes[1:]
    size = sum(
        _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in shapes
    )
    group = first_replica_group(line, num_devices)
    algorithm = Algorithm.of(line)
    kind = ASYNC_KINDS.get(match.group(2), match.group(2))
    if kind == "all-reduce" and name in fused_scatter:
        kind, size, algorithm = "reduce-scatter", size // len(group), fused_scatter[name]
    chain = re.search(r'chain_id="(\w+)"', line)
    return Collective(
        kind=kind,
        dtype=shapes[0][0] if shapes else "?",
        result_bytes=size,
        group_size=len(group),
        in_loop=where.depth[name] > 0,
        loop_depth=where.depth[name],
        trips=where.trips.get(name, 1),
        is_async=is_async,
        emitter=algorithm.emitter,
        group=group,
        algorithm=algorithm,
        name=instruction_name(line),
        computation=name,
        chain=chain.group(1) if chain else "",
    )


@dataclasses.dataclass(frozen=True)
class DcnTransfer:
    """One collective step between slices over the data-center network.

    A multi-slice TPU program is the program of one slice: its collectives' replica
    groups are that slice's devices (ICI), and what crosses slices is a ``send`` to
    libtpu's megascale runtime (``_xla_host_transfer_handler_name="xla_megascale_runtime"``),
    of a kind (``_xla_megascale_transfer_type``) over the slices its target names
    (``_xla_megascale_target="{1,2}x{0:31}"``: slices 1 and 2, devices 0-31 of each).

    Attributes:
      kind: ``ALL_REDUCE``, ``REDUCE_SCATTER`` or ``ALL_GATHER``.
      bytes: bytes each device sends into it (the send's operand).
      slices: how many slices take part.
      in_loop: whether it runs inside the K-step loop (once per step).
      name: the send's instruction name.
      trips: how many times it runs per run of the program (as :class:`Collective`'s).
    """

    kind: str
    bytes: int
    slices: int
    in_loop: bool
    name: str = ""
    trips: int = 1
    # The fields the send did not print, and what stands in for them.
    assumed: tuple[str, ...] = ()

    def per_step(self, steps_per_loop: int, has_loop: bool) -> float:
        """How many times it runs per training step (as :meth:`Collective.per_step`)."""
        return self.trips / (steps_per_loop if has_loop else 1)

    @property
    def wire_bytes(self) -> float:
        """Bytes each device puts on the DCN: ``2 (S-1)/S`` of its buffer for an
        all-reduce over S slices, ``(S-1)/S`` for the others."""
        share = (self.slices - 1) / max(self.slices, 1)
        return (2 if self.kind == "ALL_REDUCE" else 1) * share * self.bytes


def dcn_transfers(hlo_text: str, num_slices: int) -> list[DcnTransfer]:
    """The transfers of a compiled multi-slice TPU program that cross slices.

    Each send names its kind (``_xla_megascale_transfer_type``) and the slices it
    reaches (``_xla_megascale_target="{0,1}"``). Where one is missing or written
    otherwise, the transfer says so in ``assumed``: its slices are then the
    program's ``num_slices``, an unknown kind counts as one pass over the buffer,
    and a send without an operand shape as 0 bytes.
    """
    bodies = computations(hlo_text)
    where = loops(bodies)
    found = []
    for name, lines in bodies.items():
        for line in lines:
            ins = instruction(line)
            if ins is None or ins.opcode != "send" or "xla_megascale_runtime" not in line:
                continue
            kind = re.search(r'_xla_megascale_transfer_type="(\w+)"', line)
            target = re.search(r'_xla_megascale_target="\{([\d,]*)\}', line)
            data = _SHAPE.findall(ins.type_text)[:1]  # (operand, u32, token)
            assumed = []
            if not kind:
                assumed.append("kind: not printed")
            if not target:
                assumed.append(f"slices: no target list printed, taken as all {num_slices}")
            if not data:
                assumed.append("bytes: no operand shape printed, taken as 0")
            found.append(
                DcnTransfer(
                    kind=kind.group(1) if kind else "?",
                    bytes=shape_bytes("{}[{}]".format(*data[0])) if data else 0,
                    slices=len(ints(target.group(1))) if target else num_slices,
                    in_loop=where.depth[name] > 0,
                    trips=where.trips.get(name, 1),
                    name=ins.name,
                    assumed=tuple(assumed),
                )
            )
    return found


def bytes_by_kind(
    found: list[Collective], *, steps_per_loop: int = 1, has_loop: bool = True
) -> dict[str, float]:
    """``{"<kind>/<dtype>": wire bytes per device per step}``: each collective times
    the times it runs a step (:meth:`Collective.per_step`), in a program of
    ``steps_per_loop`` steps."""
    out: dict[str, float] = collections.defaultdict(float)
    for c in found:
        out[f"{c.kind}/{c.dtype}"] += c.wire_bytes * c.per_step(steps_per_loop, has_loop)
    return dict(out)
