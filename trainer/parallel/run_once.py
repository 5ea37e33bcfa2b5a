"""How the programs a run executes once are compiled: at LLVM's level 1 on CPU.

XLA:CPU compiles a program's kernels through LLVM at level 3 by default, and that
optimisation is most of a compile. A training loop runs its kernels thousands of
times and earns it; the programs a run executes once do not: the sharded
initialisation of the parameters and the optimizer state
(:func:`trainer.training.experiment.build`'s ``init``), and the optimizer's layout
check (:func:`trainer.parallel.transform.check_layout_agnostic`, always on the
host's CPU). Level 1 takes a third to a half off their compile and keeps level 3's
kernel speed; level 0 compiles faster still but draws random numbers seven times
slower, which a larger model's init would pay for.

Measured on this project's 2-core machine, the sharded ``init`` program alone
(seconds to compile + to run, each level twice in the order 1 3 0 3 1 0 in one
process, JAX's caches cleared before each compile; 8 CPU devices; the decoders are
``scripts/maxtext_side_by_side.py``'s):

========================================  ===============  =============  =================
program                                   level 3          level 1        level 0
========================================  ===============  =============  =================
``init`` of the 64M decoder (per_layer)   10.5-11.4 + 0.7  6.1-6.4 + 0.7  5.5-5.9 + 4.6-5.4
``init`` of the 2M decoder (per_layer)    5.1-5.3 + 0.0    3.5-3.7 + 0.0  2.4-2.9 + 0.1
``init`` of the ``:tiny`` Transformer     6.8-7.3 + 0.0    2.8-3.8 + 0.0  2.6-2.8 + 0.0
========================================  ===============  =============  =================

Where ``XLA_FLAGS`` sets a level (``--xla_backend_optimization_level``) that level
stands: a compile option would override it, and whoever set it chose it for every
program. TPU and GPU programs compile as they always did.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import jax

LEVEL = "xla_backend_optimization_level"


def options(devices: Iterable[jax.Device]) -> dict[str, int] | None:
    """The ``compiler_options`` of a program run once on ``devices``: LLVM level 1
    where they are CPUs and ``XLA_FLAGS`` sets no level, else None (the defaults)."""
    if f"--{LEVEL}" in os.environ.get("XLA_FLAGS", ""):
        return None
    if all(d.platform == "cpu" for d in devices):
        return {LEVEL: 1}
    return None
