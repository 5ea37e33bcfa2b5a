"""The weights a layer of a stack computes with, when they are not its parameters as
stored: a stack whose parameters stay sharded through the scan over its layers, each
layer's slice gathered inside the scan's body when that layer runs
(``optimizer.update_sharding="per_layer"``, :mod:`trainer.parallel.plan`).

The trainer says how, per stack, for the length of a trace (:func:`transforming`); a
model wraps the layer class it scans with :func:`in_stack` (through
:func:`models.remat.remat_layer`), which applies the transform to the layer's
``params`` as the layer reads them (``nn.map_variables``). Outside such a trace
(initialisation, evaluation, decoding) a layer reads its parameters as they are.

:func:`models.remat.remat_layer` rematerialises such a layer so that it never keeps
the transformed weights for its backward pass, which transforms (gathers) them
again, a layer at a time.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn

Transform = Callable[[Any], Any]  # a layer's params tree -> the weights it computes with

_local = threading.local()


def active(stack: str) -> Transform | None:
    """The transform of ``stack``'s layer weights in the current trace, if any."""
    return getattr(_local, "transforms", {}).get(stack)


@contextlib.contextmanager
def transforming(transforms: Mapping[str, Transform]) -> Iterator[None]:
    """Within the block, a layer of stack ``name`` (the scanned module's name, e.g.
    ``layers``) computes with ``transforms[name](its params)``."""
    before = getattr(_local, "transforms", {})
    _local.transforms = {**before, **transforms}
    try:
        yield
    finally:
        _local.transforms = before


def in_stack(layer: type[nn.Module], stack: str) -> type[nn.Module]:
    """``layer`` reading its ``params`` through the transform of ``stack`` when one is
    active (when the model is set up, i.e. traced), else ``layer`` itself."""
    transform = active(stack)
    if transform is None:
        return layer
    return nn.map_variables(
        layer, "params", trans_in_fn=lambda tree: {"params": transform(tree["params"])}
    )
