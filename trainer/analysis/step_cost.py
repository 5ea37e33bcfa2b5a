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
may be sharded at depth L, which changes their update's bytes, not the layers'; and
a layer does not cost the same at every depth. On Transformer-big (v3:32x32, wus)
the twins put XLA's seconds 27% above the unrolled model's (docs/aot.md), so
``unroll=True`` (``trainer.aot --unroll``) compiles the whole model instead, where
that is affordable.

What XLA's figures leave out or get wrong, set right here:

* each ``ConcatBitcast`` custom call counts -1 s in ``optimal_seconds`` (libtpu
  0.0.42.1: 21 of them -20.98 s, 80: -79.97 s, on programs whose true figure is
  0.02 s); it is added back;
* the Pallas flash-attention kernels (``model.attention="flash"``): XLA takes the
  forward kernel's own cost estimate (its FLOPs for the full square of scores, as
  the kernel states them) but its backward kernels (``flash_mha_bwd_dkv``,
  ``flash_mha_bwd_dq``) state none and count 0. Their FLOPs are read from the looped
  program itself, every layer's (:func:`trainer.analysis.flops.attention_kernels`,
  times the trips of the scan around them): ``uncosted_flops``, which the step
  estimate adds at the chip's peak: 7 score matmuls a layer (its dK/dV kernel 4,
  its dQ kernel 3). The rule before this took 2.5 times every forward kernel of the
  twins' text, the rematerialised forward included (5 a layer under full remat).
* the twins lose matmuls the looped program runs: unrolled, a layer rematerialised
  without ``prevent_cse`` (``models/layer_stack.py`` sets it only outside a scan)
  shares part of its recomputed forward pass with the forward pass itself, which the
  scan keeps apart. ``dot_flops`` are the looped program's own matmul FLOPs a step
  (:func:`trainer.analysis.flops.dot_flops`), a floor under what the step computes;
  ``matmul_shortfall_flops`` is how far the twins' FLOPs fall below it, which the
  step estimate adds at the chip's peak.
"""

from __future__ import annotations

import dataclasses
import time

from trainer.analysis import flops
from trainer.errors import ConfigError
from trainer.training import experiment

# The figures of XLA's cost analysis the estimates read, extrapolated per layer.
KEYS = ("flops", "bytes accessed", "optimal_seconds")


@dataclasses.dataclass(frozen=True)
class StepCost:
    """XLA's per-step figures and how they were had.

    Attributes:
      flops: FLOPs per step per device.
      bytes_accessed: HBM bytes per step per device.
      optimal_seconds: XLA's roofline of the step (negative: not usable; see
        :mod:`trainer.analysis.compiled`).
      how: ``program`` (no layer scan, no twins asked for, or a twin that could not
        be built: then why), ``unrolled`` or ``extrapolated``.
      compile_s: seconds spent compiling twins for them (0 for ``program``).
      uncosted_flops: FLOPs of kernels XLA counts as free (flash attention's
        backward), per step, read from the looped program; not in ``flops`` nor in
        ``optimal_seconds``.
      dot_flops: the looped program's own matmul FLOPs per step, every layer's.
    """

    flops: float
    bytes_accessed: float
    optimal_seconds: float
    how: str
    compile_s: float = 0.0
    uncosted_flops: float = 0.0
    dot_flops: float = 0.0

    @property
    def matmul_shortfall_flops(self) -> float:
        """How far ``flops`` falls below the program's own matmul FLOPs (0 if not)."""
        return max(0.0, self.dot_flops - self.flops)


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
    return figures


def program_flops(text: str, steps_per_loop: int) -> tuple[float, float]:
    """``(matmul FLOPs, FLOPs of the kernels XLA counts as free)`` a step of the
    program ``text`` runs, every trip of its loops counted: its convolutions and dots
    (:func:`trainer.analysis.flops.dot_flops`), and the flash-attention backward kernels
    (:func:`trainer.analysis.flops.attention_kernels`), which state no cost of their own."""
    per_step = 1 / (steps_per_loop if " while(" in text else 1)
    backward = sum(
        count * trips for count, stated, trips in flops.attention_kernels(text) if not stated
    )
    return flops.dot_flops(text) * per_step, backward * per_step


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
        body counted once (``how="program"``, no compile); not with ``unroll``.
    """
    if unroll and not twins:
        raise ValueError("unroll=True compiles the model unrolled, twins=False compiles nothing")
    text = compiled.as_text() if text is None else text
    dots, uncosted = program_flops(text, config.steps_per_loop)
    measured = {"dot_flops": dots, "uncosted_flops": uncosted}
    depths = stack_depths(config)
    if not depths or not twins:
        return StepCost(**_keyed(_figures(compiled, text)), how="program", **measured)
    start = time.perf_counter()
    deeper = sum(depth > 1 for depth in depths.values())
    twin_layers = len(depths) + deeper * (len(depths) + 1)
    try:
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
    except ConfigError as e:
        # A twin the trainer refuses to build (a shallower stack is another layout):
        # the program's own figures, its other layers' matmuls added from dot_flops
        # (matmul_shortfall_flops), rather than no figures for a compiled program.
        return StepCost(
            **_keyed(_figures(compiled, text)),
            how=f"program (a twin failed: {str(e)[:200]})",
            compile_s=time.perf_counter() - start,
            **measured,
        )
    return StepCost(**_keyed(figures), how=how, compile_s=time.perf_counter() - start, **measured)


def _keyed(figures: dict[str, float]) -> dict[str, float]:
    return {
        "flops": figures["flops"],
        "bytes_accessed": figures["bytes accessed"],
        "optimal_seconds": figures["optimal_seconds"],
    }
