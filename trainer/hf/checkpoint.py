"""A Hugging Face model directory as a run's initial parameters (``init_from=DIR``).

Each of the run's parameters is placed straight into its stored, sharded layout
(:mod:`trainer.parallel.placing`) from the safetensors files, read a tensor at a
time (:mod:`trainer.hf.safetensors_files`) and converted to our layout
(:mod:`trainer.hf.names`): a stack of layers reads its layers one by one, and only
the rows of each device's block. The host holds a tensor or two and a device's
block, never the model; the devices never hold a replicated copy.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import math
import os

import jax
import numpy as np
from flax import traverse_util

from models import stacking
from trainer.errors import ConfigError
from trainer.hf import config as hf_config
from trainer.hf import names as names_lib
from trainer.hf import safetensors_files
from trainer.parallel import placing
from trainer.parallel import plan as plan_lib
from trainer.parallel.rules import param_name


def is_model_directory(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model directory (``config.json`` naming
    ``architectures``), not a run's or an export (whose ``config.json`` is ours)."""
    return hf_config.is_model_directory(path)


def check_model(directory: str | os.PathLike, model) -> None:
    """Raises ConfigError naming the first ``config.json`` field that disagrees with
    ``model`` (``config.model``): another size than the run builds."""
    hf = hf_config.read(directory)
    path = os.path.join(os.fspath(directory), hf_config.FILE)
    keys = hf_config.model_keys(hf, path)
    for key, value in keys.items():
        if key in ("name", "init_std", "max_len") or key not in model:
            continue
        mine = model[key]
        same = math.isclose(mine, value) if isinstance(value, float) else mine == value
        if not same:
            field = next((f for f, k in hf_config.MAPPED.items() if k == key and f in hf), key)
            raise ConfigError(
                f"init_from={directory}: its config.json gives {field}={hf.get(field, value)!r}"
                f" but this run has model.{key}={mine!r} (build the model from it: "
                f"configs/llama.py:hf={directory})"
            )


def check_tensors(
    what: str, reader: safetensors_files.Reader, tensors: dict[str, names_lib.Tensor]
) -> None:
    """Raises ConfigError naming the first of ``tensors`` (ours -> theirs) that the
    files lack, or hold in another shape than ``config.json`` gives it, or in a dtype
    that is not floating-point (an integer norm scale would be taken as its values)."""
    for ours, tensor in tensors.items():
        entry = reader.entries.get(tensor.name)
        if entry is None:
            raise ConfigError(f"{what}: no tensor {tensor.name} in its safetensors")
        file = os.path.basename(entry.file)
        if entry.shape != tensor.shape:
            raise ConfigError(
                f"{what}: tensor {tensor.name} in {file} has shape {entry.shape}, but "
                f"config.json makes it {tensor.shape} ({ours})"
            )
        if not entry.floating:
            raise ConfigError(
                f"{what}: tensor {tensor.name} in {file} is {entry.dtype.name}: a weight is "
                "floating-point (BF16, F16, F32 or F64); this file is damaged or quantized"
            )


class _Layers:
    """Our per-layer arrays from the files, converted; the last few kept (neighbouring
    device blocks share a layer)."""

    def __init__(self, reader: safetensors_files.Reader, tensors: dict, keep: int = 2):
        self._reader, self._tensors = reader, tensors
        self._cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._keep = keep
        self.read = 0  # tensors read, for the report

    def __call__(self, name: str) -> np.ndarray:
        if name not in self._cache:
            tensor = self._tensors[name]
            self._cache[name] = tensor.to_ours(self._reader.read(tensor.name))
            self.read += 1
            while len(self._cache) > self._keep:
                self._cache.popitem(last=False)
        return self._cache[name]


@dataclasses.dataclass(frozen=True)
class Imported:
    """What an import placed: parameters (name -> stored array), and what it read."""

    params: dict[str, jax.Array]
    tensors_read: int
    values: int
    skipped: tuple[str, ...]


def load(
    directory: str | os.PathLike,
    plan: plan_lib.UpdateShardingPlan,
    abstract_params,
    model,
    *,
    skip: tuple[str, ...] = (),
) -> Imported:
    """The run's parameters from the Hugging Face model at ``directory``, each placed in
    the plan's stored layout and sharding (``skip``: fnmatch patterns of parameters
    left to their initialisers).

    Raises:
      ConfigError: a field of ``config.json`` this run cannot build, a missing shard,
        a file cut short, a tensor missing, of another shape than ``config.json``
        says, or not floating-point.
    """
    check_model(directory, model)
    reader = safetensors_files.Reader(directory)
    tensors = names_lib.per_layer(model)
    check_tensors(f"init_from={directory}", reader, tensors)
    layouts = traverse_util.flatten_dict(
        jax.tree.map(lambda x: x, plan.layouts, is_leaf=plan_lib.is_layout), sep="/"
    )
    shardings = traverse_util.flatten_dict(plan.stored_shardings(), sep="/")
    dtypes = {
        param_name(path): leaf.dtype
        for path, leaf in jax.tree_util.tree_leaves_with_path(abstract_params)
    }
    wanted = {name: _Shape(layout.shape) for name, layout in layouts.items()}
    skipped = tuple(n for n in wanted if any(fnmatch.fnmatchcase(n, p) for p in skip))
    have = {name: _Shape(tensor.ours) for name, tensor in tensors.items()}
    sources = stacking.match({n: s for n, s in wanted.items() if n not in skipped}, have)
    missing = sorted(set(wanted) - set(sources) - set(skipped))
    if missing:
        raise ConfigError(f"init_from={directory}: nothing in it gives {', '.join(missing[:5])}")
    layers = _Layers(reader, tensors)
    params = {}
    for name, source in sources.items():
        stacked = source.stacked

        def read(i, source=source):
            return layers(source.names[i] if i is not None else source.names[0])

        params[name] = placing.place(
            layouts[name], shardings[name], dtypes[name], read, stacked=stacked
        )
    values = sum(math.prod(layouts[n].shape) for n in params)
    return Imported(params, layers.read, values, skipped)


@dataclasses.dataclass(frozen=True)
class _Shape:
    """A stand-in leaf: a shape (what :func:`models.stacking.match` reads)."""

    shape: tuple[int, ...]
