"""What a compiled TPU program runs while its asynchronous collectives are in flight.

The optimized HLO of a TPU program is scheduled: each computation lists its
instructions in the order they run. An asynchronous collective overlaps

* the instructions between its ``-start`` and its ``-done`` (``all-gather-start``
  ... ``all-gather-done``), or
* the work of the kernel it is fused into (XLA's async collective fusion puts the
  gather of the next layer's weights into the fusion that runs this layer's matmul:
  ``async-collective-start``, that fusion, ``async-collective-done``).

That work is timed by the HBM bytes it moves (each instruction's operands and
results) at the chip's HBM bandwidth: a floor for it (matmul time is left out), so
the collective time this hides is a lower bound. Bookkeeping instructions (tuples,
bitcasts, parameters, constants) move nothing.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from trainer.analysis import hlo

# Instructions that name or view buffers without moving them.
_FREE = {
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "bitcast",
    "after-all",
    "partition-id",
    "replica-id",
}
_OPERANDS = re.compile(r"%([\w.\-]+)")


def _moved_bytes(line: str, shapes: dict[str, int]) -> int:
    """HBM bytes an instruction moves: its result and its operands (0 for bookkeeping)."""
    ins = hlo.instruction(line)
    if ins is None or ins.opcode in _FREE or ins.opcode.endswith("-done"):
        return 0
    operands = ins.rest.split("),")[0]  # up to the end of the operand list
    return hlo.shape_bytes(ins.type_text) + sum(
        shapes.get(name, 0) for name in _OPERANDS.findall(operands)
    )


def window_bytes(hlo_text: str, collectives: Sequence[hlo.Collective]) -> dict[str, int]:
    """For each asynchronous collective (by instruction name), the HBM bytes of the
    work the schedule runs while it is in flight (module docstring)."""
    bodies = hlo.computations(hlo_text)
    out = {}
    for c in collectives:
        if not c.is_async:
            continue
        if c.fused_with:
            caller = next(
                (
                    name
                    for name, lines in bodies.items()
                    if any(hlo.instruction_name(line) == c.fused_with for line in lines)
                ),
                None,
            )
            lines, start, stop = bodies.get(caller, []), c.fused_with, c.fused_with
        else:  # from the -start to the -done that takes it
            lines = bodies.get(c.computation, [])
            start = c.name
            stop = next(
                (
                    ins.name
                    for ins in map(hlo.instruction, lines)
                    if ins
                    and ins.opcode.endswith("-done")
                    and re.search(rf"%{re.escape(start)}(?![\w.\-])", ins.rest)
                ),
                None,
            )
        shapes = {hlo.instruction_name(line): _result_bytes(line) for line in lines}
        names = [hlo.instruction_name(line) for line in lines]
        if start not in names:
            out[c.name] = 0
            continue
        first = names.index(start)
        last = names.index(stop, first) if stop in names[first:] else len(names) - 1
        inside = lines[first : last + 1] if c.fused_with else lines[first + 1 : last]
        out[c.name] = sum(_moved_bytes(line, shapes) for line in inside)
    return out


def _result_bytes(line: str) -> int:
    ins = hlo.instruction(line)
    return hlo.shape_bytes(ins.type_text) if ins else 0
