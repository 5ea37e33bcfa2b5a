"""What a compiled TPU program runs while its asynchronous collectives are in flight.

The optimized HLO of a TPU program is scheduled: each computation lists its
instructions in the order they run. An asynchronous collective overlaps

* the instructions between its ``-start`` and its ``-done`` (``all-gather-start``
  ... ``all-gather-done``), or
* the work of the kernels it is fused into (XLA's async collective fusion puts the
  gather of the next layer's weights into the fusions that run this layer's matmuls:
  ``async-collective-start``, one or more ``async_collective_fusion`` kernels each
  running a step of it, ``async-collective-done``; :func:`trainer.analysis.hlo.collectives`).

:func:`window_bytes` measures that work by the HBM bytes it moves (each instruction's
operands and results; bookkeeping instructions - tuples, bitcasts, parameters,
constants - move nothing). The step estimate times it by each kernel's roofline,
FLOPs at peak or bytes at bandwidth, whichever is longer
(:func:`trainer.analysis.program.window_seconds`): a gather fused with a matmul is
hidden for as long as the matmul runs, not only as long as its bytes take.
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


def _moved_bytes(line: str, types: dict[str, str]) -> int:
    """HBM bytes an instruction moves: its result and its operands (0 for bookkeeping)."""
    ins = hlo.instruction(line)
    if ins is None or ins.opcode in _FREE or ins.opcode.endswith("-done"):
        return 0
    return hlo.shape_bytes(ins.type_text) + sum(
        hlo.operand_bytes(ref, types) for ref in hlo.operands(ins.rest)
    )


def window_bytes(hlo_text: str, collectives: Sequence[hlo.Collective]) -> dict[str, int]:
    """For each asynchronous collective (by instruction name), the HBM bytes of the
    work the schedule runs while it is in flight (module docstring)."""
    bodies = hlo.computations(hlo_text)
    where = {hlo.instruction_name(line): name for name, lines in bodies.items() for line in lines}
    out = {}
    for c in collectives:
        if not c.is_async:
            continue
        if c.fused_with:  # the kernels that run its steps, wherever the schedule puts them
            lines = bodies.get(where.get(c.fused_with[0]), [])
            kernels = set(c.fused_with)
            inside = [line for line in lines if hlo.instruction_name(line) in kernels]
        else:  # from the -start to the -done that takes it
            lines = bodies.get(c.computation, [])
            names = [hlo.instruction_name(line) for line in lines]
            stop = next(
                (
                    ins.name
                    for ins in map(hlo.instruction, lines)
                    if ins
                    and ins.opcode.endswith("-done")
                    and re.search(rf"%{re.escape(c.name)}(?![\w.\-])", ins.rest)
                ),
                None,
            )
            if c.name not in names:
                out[c.name] = 0
                continue
            first = names.index(c.name)
            last = names.index(stop, first) if stop in names[first:] else len(names) - 1
            inside = lines[first + 1 : last]
        types = {ins.name: ins.type_text for ins in map(hlo.instruction, lines) if ins}
        out[c.name] = sum(_moved_bytes(line, types) for line in inside)
    return out
