"""XLA's cost analysis of one training step (FLOPs, HBM bytes, ``optimal_seconds``),
for a model whose layers run in a scan.

XLA counts the body of a ``while`` once: right for the K-step loop (that is one
step), too little for a loop over a model's layers inside it (``model.scan_layers``:
one layer of each stack counted, not all). The figures of such a program are those
of twins of it compiled with the layers unrolled, at depth 1 and at depth 2 for each
stack: one more layer costs what the second one adds, so a stack of L layers costs
``c(1) + (L - 1) (c(2) - c(1))``. Compiling an 80-layer model unrolled would take as
long as 80 layers; the twins take as long as two (``tests/analysis/test_aot.py``
holds the extrapolation against the full unroll of a small model); a model with no
more layers than the twins together is compiled unrolled instead. What the twins
leave out: a layer's parameters below ``optimizer.min_shard_bytes`` at depth 1 or 2
may be sharded at depth L, which changes their update's bytes, not the layers'.

Two things XLA's figures leave out or get wrong, set right here (libtpu 0.0.42.1):

* each ``ConcatBitcast`` custom call counts -1 s in ``optimal_seconds`` (21 of them:
  -20.98 s, 80: -79.97 s, on programs whose true figure is 0.02 s); it is added back;
* the Pallas flash-attention kernels (``model.attention="flash"``): XLA takes the
  forward kernel's own cost estimate (its FLOPs for the full square of scores, as
  the kernel states them) but its backward kernels (``flash_mha_bwd_*``) state none
  and count 0. They are taken as 2.5 times the forward's FLOPs (FlashAttention-2's
  backward runs five matmuls of the forward's two sizes), run at the chip's peak:
  ``uncosted_flops``, which the step estimate adds at peak.
"""

from __future__ import annotations

import dataclasses
import re
import time

from trainer.training import experiment

# The figures of XLA's cost analysis the estimates read, extrapolated per layer.
KEYS = ("flops", "bytes accessed", "optimal_seconds", "uncosted")
_FLASH_BACKWARD = 2.5  # FlashAttention-2: 5 matmuls backward to the forward's 2


@dataclasses.dataclass(frozen=True)
class StepCost:
    """XLA's per-step figures and how they were had.

    Attributes:
      flops: FLOPs per step per device.
      bytes_accessed: HBM bytes per step per device.
      optimal_seconds: XLA's roofline of the step (negative: not usable; see
        :mod:`trainer.analysis.compiled`).
      how: ``program`` (no layer scan), ``unrolled`` or ``extrapolated``.
      compile_s: seconds spent compiling twins for them (0 for ``program``).
      uncosted_flops: FLOPs of kernels XLA counts as free (flash attention's
        backward), per step; not in ``flops`` nor in ``optimal_seconds``.
    """

    flops: float
    bytes_accessed: float
    optimal_seconds: float
    how: str
    compile_s: float = 0.0
    uncosted_flops: float = 0.0


def stack_depths(config) -> dict[str, int]:
    """``{model.num_*layers key: depth}`` of a model whose layers run in a scan."""
    model = config.model
    if "scan_layers" not in model or not model.scan_layers:
        return {}
    return {k: int(v) for k, v in model.items() if k.startswith("num_") and k.endswith("layers")}


def _figures(compiled, text: str | None = None) -> dict[str, float]:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    figures = {key: float(cost.get(key, 0.0)) for key in KEYS}
    text = compiled.as_text() if text is None else text
    figures["optimal_seconds"] += text.count('custom_call_target="ConcatBitcast"')
    if "flash_mha_bwd" in text:
        forward = [
            float(m.group(1))
            for line in text.splitlines()
            if "tpu_custom_call" in line and "flash_attention" in line
            for m in [re.search(r'"flops"\s*:\s*"?(\d+)', line)]
            if m
        ]
        figures["uncosted"] = _FLASH_BACKWARD * sum(forward)
    return figures


def _twin(config, devices, depths: dict[str, int]) -> dict[str, float]:
    """The figures of ``config`` with its stacks at ``depths``, unrolled."""
    twin = config.copy_and_resolve_references()
    twin.model.update(depths)
    twin.model.scan_unroll = max(depths.values())
    exp = experiment.build(twin, devices=devices, with_data=False)
    lowered = experiment.lower_loop(exp, twin.steps_per_loop)
    return _figures(experiment.compile_lowered(lowered, twin, xla_tpu_no_crash_on_oom=True))


def per_step(
    compiled, config, devices, *, unroll: bool = False, text: str | None = None, twins: bool = True
) -> StepCost:
    """The per-step figures of ``compiled``, the program of ``config`` on ``devices``.

    Args:
      text: ``compiled.as_text()``, where the caller has it (seconds to print for a
        large program).
      unroll: compile the whole model unrolled instead of extrapolating from depths
        1 and 2 (what the extrapolation is tested against; as slow as the model is
        deep). A model no deeper than the twins together is unrolled anyway: exact,
        and fewer layers to compile.
      twins: False takes XLA's figures of ``compiled`` as they are, a layer scan's
        body counted once (``how="program"``, no compile).
    """
    depths = stack_depths(config)
    if not depths or not twins:
        return StepCost(**_keyed(_figures(compiled, text)), how="program")
    start = time.perf_counter()
    deeper = sum(depth > 1 for depth in depths.values())
    twin_layers = len(depths) + deeper * (len(depths) + 1)
    if unroll or sum(depths.values()) <= twin_layers:
        figures, how = _twin(config, devices, depths), "unrolled"
    else:
        one = dict.fromkeys(depths, 1)
        base = _twin(config, devices, one)
        figures, how = dict(base), "extrapolated"
        for stack, depth in depths.items():
            if depth > 1:
                two = _twin(config, devices, {**one, stack: 2})
                for key in KEYS:
                    figures[key] += (depth - 1) * (two[key] - base[key])
    return StepCost(**_keyed(figures), how=how, compile_s=time.perf_counter() - start)


def _keyed(figures: dict[str, float]) -> dict[str, float]:
    return {
        "flops": figures["flops"],
        "bytes_accessed": figures["bytes accessed"],
        "optimal_seconds": figures["optimal_seconds"],
        "uncosted_flops": figures["uncosted"],
    }
