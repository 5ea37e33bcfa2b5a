"""A decoder run's checkpoint as a Hugging Face model directory (``--format hf``).

What ``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` and
``AutoTokenizer.from_pretrained(OUT)`` load: ``config.json`` (``LlamaForCausalLM``,
``MistralForCausalLM`` or ``Qwen2ForCausalLM``: :mod:`trainer.hf.config`),
``generation_config.json``, the weights as ``model-0000N-of-0000M.safetensors`` shards
with ``model.safetensors.index.json``, and the tokenizer files
(:mod:`trainer.hf.tokenizer_files`).

The weights stream a saved leaf at a time: each parameter of the checkpoint is read
on its own (a partial restore of that one leaf, onto one CPU device), cut into its
Hugging Face tensors (a stack of layers gives one per layer), each converted to their
layout (:mod:`trainer.hf.names`) and written to the shard being filled. The host
holds one saved leaf (for a stack, that weight of every layer) and a tensor.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator

import jax
import ml_dtypes
import numpy as np
from etils import epath
from flax import traverse_util

from models import stacking
from trainer import tasks
from trainer.checkpoint.reader import CheckpointReader
from trainer.errors import ConfigError
from trainer.hf import config as hf_config
from trainer.hf import names as names_lib
from trainer.hf import safetensors_files, tokenizer_files
from trainer.inference import export as export_lib
from trainer.inference import loading
from trainer.input import tokenizer as tokenizer_lib
from trainer.workdir import run_config, storage

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote: the checkpoint's step, the architecture, the shards, and
    the bytes of the weights and of the largest tensor."""

    step: int
    architecture: str
    shards: int
    total_bytes: int
    largest_bytes: int


@dataclasses.dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


def export(
    workdir: str | epath.PathLike,
    out: str | epath.PathLike,
    *,
    step: int | None = None,
    dtype: str = "float32",
    max_shard_bytes: int = 5 * 2**30,
) -> Exported:
    """Writes checkpoint ``step`` (default the newest) of the decoder run in
    ``workdir`` as a Hugging Face model directory ``out``, weights in ``dtype``.

    Raises:
      ConfigError: ``out`` exists and is not empty, the run is not a decoder's, or
        its model is not one the architectures hold (a parallel block, a ReLU MLP).
      CheckpointError: no such checkpoint, or it cannot be read.
    """
    destination = export_lib.check_destination(out)
    directory = storage.workdir(workdir)
    config = run_config.load(directory)
    loading.require_family(config, "decoder")
    tokenizer = _tokenizer(directory, config)
    settings = hf_config.hf_config(
        config.model, bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, dtype=dtype
    )
    checkpoints = CheckpointReader(directory)
    try:
        step = checkpoints.resolve_step(step)
        saved = traverse_util.flatten_dict(checkpoints.state_metadata(step)["params"], sep="/")
        tensors = names_lib.per_layer(config.model)
        sources = stacking.match({n: _Shape(t.ours) for n, t in tensors.items()}, saved)
        if missing := [n for n in tensors if n not in sources]:
            raise ConfigError(f"checkpoint {step} of {directory} has no {', '.join(missing[:5])}")
        sizes: list[int] = []
        weights = _weights(checkpoints, step, saved, tensors, sources, DTYPES[dtype], sizes)
        destination.mkdir(parents=True, exist_ok=True)
        weight_map = safetensors_files.write(destination, weights, max_shard_bytes=max_shard_bytes)
    finally:
        checkpoints.close()
    files = {
        hf_config.FILE: json.dumps(settings, indent=2).encode(),
        hf_config.GENERATION_FILE: json.dumps(
            hf_config.generation_config(bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id),
            indent=2,
        ).encode(),
        **tokenizer_files.files(tokenizer),
    }
    for name, data in files.items():
        storage.write_atomically(destination / name, data)
    return Exported(
        step, settings["architectures"][0], len(set(weight_map.values())), sum(sizes), max(sizes)
    )


def _weights(
    checkpoints: CheckpointReader,
    step: int,
    saved: dict,
    tensors: dict[str, names_lib.Tensor],
    sources: dict[str, stacking.Source],
    dtype: np.dtype,
    sizes: list[int],
) -> Iterator[tuple[str, np.ndarray]]:
    """``(Hugging Face name, array)`` of every tensor, a saved leaf read at a time
    (``sizes`` gets each tensor's bytes)."""
    device = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    by_leaf: dict[str, list[str]] = {}
    for name, source in sources.items():
        by_leaf.setdefault(source.names[0], []).append(name)
    for leaf, ours in by_leaf.items():
        metadata = saved[leaf]
        # Read in the export's dtype: Orbax casts as it reads, the float32 leaf never whole.
        target = jax.ShapeDtypeStruct(metadata.shape, dtype, sharding=device)
        part = {"params": traverse_util.unflatten_dict({leaf: target}, sep="/")}
        restored = checkpoints.restore_state_parts(step, part, partial=True)["params"]
        value = np.asarray(traverse_util.flatten_dict(restored, sep="/")[leaf])
        del restored  # the leaf is held once, as ``value``
        for name in ours:
            index = sources[name].index
            tensor = tensors[name]
            theirs = tensor.to_theirs(value if index is None else value[index])
            sizes.append(theirs.nbytes)
            yield tensor.name, theirs


def _tokenizer(directory: epath.Path, config) -> tokenizer_lib.TextTokenizer:
    """The tokenizer the run kept in ``directory``."""
    kept = {
        name: (directory / name).read_bytes()
        for name in tasks.run_file_names(config)
        if (directory / name).exists()
    }
    return tokenizer_lib.tokenizer_from_files(kept, str(directory))
