"""Reading collectives out of the HLO after SPMD partitioning.

The CPU backend later promotes bf16 collectives to f32 and rewrites
reduce-scatter as all-reduce + slice, so the compiled program does not show
what a TPU or GPU would run. The module right after the SPMD partitioner does:
it is dumped during compilation and parsed here.
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

_DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
    "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8,
}  # fmt: skip
_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
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
    """

    kind: str
    dtype: str
    result_bytes: int
    group_size: int
    in_loop: bool

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


def _group_size(line: str, num_devices: int) -> int:
    match = re.search(r"replica_groups=\{(\{[\d,]*\})", line)
    if match:
        return len(match.group(1).strip("{}").split(","))
    match = re.search(r"replica_groups=\[([\d,]+)\]<=", line)  # iota form [groups, size]
    if match:
        return int(match.group(1).split(",")[-1])
    match = re.search(r"replica_groups=mesh\[[^\]]*\]\s*\{([^}]*)\}", line)
    if match:  # mesh form: the named axes reduced over
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", line))
        return math.prod(int(sizes[a.strip(" '")]) for a in match.group(1).split(","))
    return num_devices


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
    in_loop: set[str] = set()
    stack = list(loop_bodies)
    while stack:
        name = stack.pop()
        if name not in in_loop:
            in_loop.add(name)
            stack.extend(calls.get(name, ()))
    found = []
    for name, lines in bodies.items():
        for line in lines:
            match = _INSTRUCTION.match(line)
            if not match or match.group(2) not in _KINDS:
                continue
            shapes = _SHAPE.findall(match.group(1))
            size = sum(
                _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
                for dt, dims in shapes
            )
            found.append(
                Collective(
                    kind=match.group(2),
                    dtype=shapes[0][0] if shapes else "?",
                    result_bytes=size,
                    group_size=_group_size(line, num_devices),
                    in_loop=name in in_loop,
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
