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
_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
_ASYNC_KINDS = {f"{k}-start": k for k in _KINDS}
_EMITTER = re.compile(r'"emitter":"(\w+)"')
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")
_SHAPE = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_CALLED = re.compile(
    r"(?:body|condition|calls|to_apply|branch_computations)=\{?([^,}\s]+(?:,\s*%[^,}\s]+)*)"
)


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
      emitter: the back end's collective algorithm (TPU ``backend_config``).
      group: the partition ids of the first replica group.
      loop_depth: how many ``while`` bodies enclose it.
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
    """Compiles ``lowered`` and returns it with its post-SPMD-partitioning HLO text."""
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
            raise RuntimeError("XLA wrote no after_spmd-partitioning dump")
        with open(files[-1]) as f:
            return compiled, f.read()


def first_replica_group(line: str, num_devices: int) -> tuple[int, ...]:
    """Partition ids of the first replica group (all devices if none is given)."""
    match = re.search(r"replica_groups=\{(\{[\d,]*\})", line)
    if match:
        return tuple(int(i) for i in match.group(1).strip("{}").split(",") if i)
    # iota form: [groups, size]<=[dims] with an optional transpose T(perm).
    match = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if match:
        shape = [int(d) for d in match.group(1).split(",")]
        ids = np.arange(math.prod(shape)).reshape([int(d) for d in match.group(2).split(",")])
        if match.group(3):
            ids = ids.transpose([int(d) for d in match.group(3).split(",")])
        return tuple(int(i) for i in ids.reshape(-1, shape[-1])[0])
    match = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
    if match:  # mesh form: ids laid out on the named axes, grouped over the listed ones
        sizes = {name: int(n) for name, n in re.findall(r"'(\w+)'=(\d+)", match.group(1))}
        over = [a.strip(" '") for a in match.group(2).split(",") if a.strip(" '")]
        names = list(sizes)
        ids = np.arange(math.prod(sizes.values())).reshape(list(sizes.values()))
        keep = [names.index(a) for a in names if a not in over]
        ids = ids.transpose(keep + [names.index(a) for a in over])
        return tuple(int(i) for i in ids.reshape(-1, math.prod(sizes[a] for a in over))[0])
    return tuple(range(num_devices))


def collectives(hlo_text: str, num_devices: int) -> list[Collective]:
    """All collectives of a partitioned HLO module, marked in-loop or not."""
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        match = _COMPUTATION.match(line)
        if match and "=" not in line.split("{")[0].split("(")[0]:
            current = match.group(1)
            bodies[current] = []
        elif current is not None:
            bodies[current].append(line)
    calls = {
        name: {
            c.strip().lstrip("%")
            for m in _CALLED.finditer("\n".join(lines))
            for c in m.group(1).split(",")
        }
        for name, lines in bodies.items()
    }
    loop_bodies = {
        m.group(1)
        for lines in bodies.values()
        for line in lines
        if " while(" in line
        for m in [re.search(r"body=%?([\w.\-]+)", line)]
        if m
    }

    def reachable(body: str) -> set[str]:
        seen, stack = set(), [body]
        while stack:
            name = stack.pop()
            if name not in seen:
                seen.add(name)
                stack.extend(calls.get(name, ()))
        return seen

    # How many while bodies enclose a computation: 1 in the K-step loop, 2 in a
    # loop nested inside it (e.g. over micro-batches).
    depth: collections.Counter[str] = collections.Counter()
    for body in loop_bodies:
        depth.update(reachable(body))
    # A TPU back end may fuse all-reduce + dynamic-slice into one kCustom fusion that
    # runs as a true reduce-scatter; its emitter sits on the fusion, not the all-reduce.
    fused_scatter = {
        called: emitter.group(1)
        for lines in bodies.values()
        for line in lines
        if "kind=kCustom" in line
        for emitter in [_EMITTER.search(line)]
        if emitter and "ReduceScatter" in emitter.group(1)
        for m in [re.search(r"calls=%?([\w.\-]+)", line)]
        if m
        for called in [m.group(1)]
    }
    found = []
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match or (match.group(2) not in _KINDS and match.group(2) not in _ASYNC_KINDS):
                continue
            shapes = _SHAPE.findall(match.group(1))
            is_async = match.group(2) in _ASYNC_KINDS
            if is_async and match.group(1).startswith("(") and len(shapes) > 1:
                # A -start returns (operands, results[, scratch]): keep the results.
                shapes = shapes[len(shapes) // 2 :] if len(shapes) % 2 == 0 else shapes[1:]
            size = sum(
                _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                for dt, dims in shapes
            )
            group = first_replica_group(line, num_devices)
            emitter = _EMITTER.search(line)
            kind = _ASYNC_KINDS.get(match.group(2), match.group(2))
            emitter = emitter.group(1) if emitter else ""
            if kind == "all-reduce" and name in fused_scatter:
                kind, size, emitter = "reduce-scatter", size // len(group), fused_scatter[name]
            found.append(
                Collective(
                    kind=kind,
                    dtype=shapes[0][0] if shapes else "?",
                    result_bytes=size,
                    group_size=len(group),
                    in_loop=depth[name] > 0,
                    loop_depth=depth[name],
                    is_async=is_async,
                    emitter=emitter,
                    group=group,
                )
            )
    return found


def bytes_by_kind(found: list[Collective], *, in_loop: bool = True) -> dict[str, float]:
    """``{"<kind>/<dtype>": wire bytes per device}`` over the chosen collectives."""
    out: dict[str, float] = collections.defaultdict(float)
    for c in found:
        if c.in_loop == in_loop:
            out[f"{c.kind}/{c.dtype}"] += c.wire_bytes
    return dict(out)
