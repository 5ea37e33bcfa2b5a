"""FLOPs of an optimized program, read from its text: its matmuls as the back end runs
them (convolutions and dots, inside their fusions) and its attention kernels (custom
calls XLA's cost analysis may count as free), every trip of the loops around them
counted (:func:`trainer.analysis.hlo.loops`).

Used to hold XLA's figures of a program's unrolled twins against the program itself
(:mod:`trainer.analysis.step_cost`), and as the compute of a program known only by its
text (:mod:`trainer.analysis.program`).
"""

from __future__ import annotations

import math
import re

from trainer.analysis.hlo import computations, dims, instruction, ints, loops, operands


def matmul_flops(line: str, types: dict[str, str]) -> float:
    """FLOPs of one ``convolution`` or ``dot`` instruction (0 for anything else), two per
    multiply-add. ``types``: the result type text of each instruction of its
    computation, by name, for the operands' shapes.

    A ``dot``: every output element over the contracted dimensions. A ``convolution``
    (how the TPU back end writes most matmuls): every output element over the kernel's
    input features and, along each spatial dimension, the window positions that fall
    inside the input; positions in the padding multiply zeros and are not counted (a
    projection to ``heads`` is written as a window of ``heads`` over a padded axis of
    1: one real position in ``heads``), as XLA's cost analysis counts them.
    """
    ins = instruction(line)
    if ins is None or ins.opcode not in ("convolution", "dot"):
        return 0.0
    out = dims(ins.type_text)
    refs = operands(ins.rest)
    if len(refs) < 2:
        return 0.0
    lhs, rhs = (dims(types.get(ref.partition("#")[0], "")) for ref in refs[:2])
    if ins.opcode == "dot":
        contracted = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", line)
        indices = ints(contracted.group(1) if contracted else "")
        return 2.0 * math.prod(out) * math.prod(lhs[i] for i in indices)
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", line)
    if labels is None or (len(labels.group(1)), len(labels.group(2))) != (len(lhs), len(rhs)):
        return 0.0
    lhs_labels, rhs_labels, out_labels = labels.groups()
    window = re.search(r"window=\{([^}]*)\}", line)
    fields = dict(re.findall(r"(\w+)=(\S+)", window.group(1))) if window else {}
    per_dim = lambda key, default: (  # noqa: E731
        [v for v in fields[key].split("x")] if key in fields else [default] * len(lhs)
    )
    sizes, pads, strides = per_dim("size", "1"), per_dim("pad", "0_0"), per_dim("stride", "1")
    macs = rhs[rhs_labels.index("i")]  # input features (per feature group)
    for label, extent in zip(out_labels, out, strict=True):
        if not label.isdigit():  # batch and output features: one each
            macs *= extent
            continue
        k = int(label)
        n, w = lhs[lhs_labels.index(label)], int(sizes[k])
        low, stride = int(pads[k].split("_")[0]), int(strides[k])
        # Window positions j of output o read input o * stride + j - low: those in [0, n).
        macs *= sum(
            max(0, min(w, n + low - o * stride) - max(0, low - o * stride)) for o in range(extent)
        )
    return 2.0 * macs


def dot_flops(hlo_text: str) -> float:
    """FLOPs of every ``convolution`` and ``dot`` of a module per run of it: each
    times the trips of the loops around it (:func:`loops`). For an optimized TPU
    program, its matmuls as the back end runs them (inside their fusions), layer
    scans and rematerialized forward passes included: a floor under what XLA's cost
    analysis of the step should count."""
    bodies = computations(hlo_text)
    where = loops(bodies)
    total = 0.0
    for name, lines in bodies.items():
        if " convolution(" not in "".join(lines) and " dot(" not in "".join(lines):
            continue
        types = {ins.name: ins.type_text for ins in map(instruction, lines) if ins}
        total += where.trips.get(name, 1) * sum(matmul_flops(line, types) for line in lines)
    return total


# Attention kernels by the name JAX's Pallas TPU kernels give their custom calls, and
# the matmuls over the [length, length] scores each runs (jax 0.12's
# pallas/ops/tpu/flash_attention.py and splash_attention): the forward 2 (scores,
# output); the backward's dK/dV kernel 4 (scores again, dV, dP, dK) and its dQ kernel 3
# (scores, dP, dQ). Longest prefix first.
ATTENTION_MATMULS = (
    ("flash_mha_bwd_dkv", 4),
    ("flash_mha_bwd_dq", 3),
    ("flash_attention", 2),
    ("splash_mha_dkv", 4),
    ("splash_mha_dq", 3),
    ("splash_mha_fwd", 2),
)


def attention_kernel(line: str) -> tuple[float, bool] | None:
    """``(FLOPs, stated)`` of an attention kernel's custom-call line; None for others.

    FLOPs are counted from the kernel's first result, ``[batch, heads, length,
    head_dim]`` (the output, dQ or dK), as :data:`ATTENTION_MATMULS` matmuls of
    ``2 batch heads length^2 head_dim`` each: the full square of scores, as the
    forward kernel states its own cost (a causal kernel skips the blocks above the
    diagonal; neither figure does). ``stated``: whether the kernel states a cost
    (``cost_estimate`` in its ``backend_config``), which XLA's cost analysis then
    counts; the others XLA counts as free.
    """
    ins = instruction(line)
    if ins is None or ins.opcode != "custom-call" or "tpu_custom_call" not in line:
        return None
    matmuls = next((n for prefix, n in ATTENTION_MATMULS if ins.name.startswith(prefix)), 0)
    shape = dims(ins.type_text)
    if not matmuls or len(shape) != 4:
        return None
    batch, heads, length, head_dim = shape
    stated = re.search(r'"cost_estimate":\{"flops":"?[1-9]', line) is not None
    return matmuls * 2.0 * batch * heads * length * length * head_dim, stated


def attention_kernels(hlo_text: str) -> list[tuple[float, bool, int]]:
    """Every attention kernel of a module (:func:`attention_kernel`): ``(FLOPs, stated,
    trips)``, ``trips`` its runs per run of the module."""
    bodies = computations(hlo_text)
    where = loops(bodies)
    return [
        (*found, where.trips.get(name, 1))
        for name, lines in bodies.items()
        for line in lines
        if (found := attention_kernel(line)) is not None
    ]
