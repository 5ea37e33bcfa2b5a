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
holds one saved leaf (for a stack, that weight of every layer) and a tensor. A
Hugging Face model directory exports too (another dtype, other shards), a tensor
at a time.

``config.json`` and ``generation_config.json`` name the tokenizer's BOS, EOS (the
model's list of them where it has one) and padding ids. Everything that can be
refused (the architecture, a tokenizer with no Hugging Face form) is refused before
the checkpoint is read, and the files are written into a directory renamed ``out``
at the end: an export that fails leaves nothing that looks whole.
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
from trainer import faults, tasks
from trainer.checkpoint.reader import CheckpointReader
from trainer.errors import ConfigError
from trainer.hf import checkpoint as hf_checkpoint
from trainer.hf import config as hf_config
from trainer.hf import names as names_lib
from trainer.hf import safetensors_files, tokenizer_files
from trainer.inference import export as export_lib
from trainer.inference import loading
from trainer.input import chat_template
from trainer.input import tokenizer as tokenizer_lib
from trainer.workdir import run_config, storage

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


@dataclasses.dataclass(frozen=True)
class Exported:
    """What an export wrote: the checkpoint's step (None from a Hugging Face
    directory), the architecture, the shards, and the bytes of the weights and of
    the largest tensor."""

    step: int | None
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
    ``workdir`` (or the Hugging Face model directory ``workdir``, in another dtype or
    shard size) as a Hugging Face model directory ``out``, weights in ``dtype``.

    Everything that can be refused is refused before a byte is written, and the
    files are written into a directory renamed ``out`` at the end
    (:func:`trainer.inference.export.staging`): a failure leaves nothing at ``out``.

    Raises:
      ConfigError: ``out`` exists and is not empty (or is in the run's checkpoints,
        or in an object store), the run is not a decoder's, its model is not one the
        architectures hold (a parallel block, a ReLU MLP), or its tokenizer has no
        Hugging Face form (a SentencePiece BPE model).
      CheckpointError: no such checkpoint, or it cannot be read.
      PathError: the destination cannot be written (a full disk), naming it.
    """
    destination = export_lib.check_destination(out, workdir)
    if storage.is_remote(destination):
        raise ConfigError(
            f"--out {destination}: --format hf writes a local directory (copy it to the "
            "bucket afterwards, e.g. with gcloud storage cp -r)"
        )
    if loading.is_hugging_face(storage.path(workdir)):
        if step is not None:
            raise ConfigError(f"--step: {workdir} is a Hugging Face model, of one step")
        return _write(destination, _HuggingFace(storage.path(workdir)), dtype, max_shard_bytes)
    directory = storage.workdir(workdir)
    config = run_config.load(directory)
    loading.require_family(config, "decoder")
    run = _Run(directory, config, step)
    try:
        return _write(destination, run, dtype, max_shard_bytes)
    finally:
        run.close()


def _write(destination: epath.Path, source, dtype: str, max_shard_bytes: int) -> Exported:
    """The export of ``source`` (:class:`_Run` or :class:`_HuggingFace`): its files
    made (and refused) first, then the weights and files written in staging."""
    tokenizer = source.tokenizer
    stops = list(tokenizer.stop_ids)
    settings = hf_config.hf_config(
        source.model,
        bos_id=tokenizer.bos_id,
        eos_id=tokenizer.eos_id,
        pad_id=tokenizer.pad_id,
        dtype=dtype,
    )
    files = {
        hf_config.FILE: json.dumps(settings, indent=2).encode(),
        **tokenizer_files.files(tokenizer),  # refuses a tokenizer it cannot write
        # The chat template a run fine-tuned with (its own file, which transformers'
        # apply_chat_template and serving stacks read beside tokenizer_config.json's).
        **source.template_files,
        hf_config.GENERATION_FILE: json.dumps(
            hf_config.generation_config(
                bos_id=tokenizer.bos_id,
                eos_id=stops[0] if len(stops) == 1 else (stops or None),
                pad_id=tokenizer.pad_id,
            ),
            indent=2,
        ).encode(),
    }
    tensors = names_lib.per_layer(source.model)
    weights = source.weights(tensors, DTYPES[dtype])  # checks the checkpoint has them all
    sizes: list[int] = []

    def counted():
        for name, array in weights:
            sizes.append(array.nbytes)
            yield name, array

    with export_lib.staging(destination) as partial:
        weight_map = safetensors_files.write(partial, counted(), max_shard_bytes=max_shard_bytes)
        faults.point("export")
        for name, data in files.items():
            storage.write_atomically(partial / name, data)
    return Exported(
        source.step,
        settings["architectures"][0],
        len(set(weight_map.values())),
        sum(sizes),
        max(sizes),
    )


class _Run:
    """A decoder run's checkpoint as the export's source: its model, tokenizer, and
    weights a saved leaf at a time (the checkpoint looked for only then: what can be
    refused without it is refused first)."""

    def __init__(self, directory: epath.Path, config, step: int | None):
        self.directory, self.model, self.step = directory, config.model, step
        self._checkpoints: CheckpointReader | None = None
        kept = {
            name: (directory / name).read_bytes()
            for name in tasks.run_file_names(config)
            if (directory / name).exists()
        }
        self.tokenizer = tokenizer_lib.tokenizer_from_files(kept, str(directory))
        self.template_files = _template_files(kept)

    def close(self) -> None:
        if self._checkpoints is not None:
            self._checkpoints.close()

    def weights(self, tensors: dict[str, names_lib.Tensor], dtype: np.dtype):
        self._checkpoints = CheckpointReader(self.directory)
        self.step = self._checkpoints.resolve_step(self.step)
        saved = traverse_util.flatten_dict(
            self._checkpoints.state_metadata(self.step)["params"], sep="/"
        )
        sources = stacking.match({n: _Shape(t.ours) for n, t in tensors.items()}, saved)
        if missing := [n for n in tensors if n not in sources]:
            raise ConfigError(
                f"checkpoint {self.step} of {self.directory} has no {', '.join(missing[:5])}"
            )
        return _weights(self._checkpoints, self.step, saved, tensors, sources, dtype)


class _HuggingFace:
    """A Hugging Face model directory as the export's source (another dtype, other
    shards): its tensors read one at a time, as they are."""

    step = None

    def __init__(self, directory: epath.Path):
        self.model = loading.read_config(directory).model
        self.tokenizer = tokenizer_lib.load_text_tokenizer(directory)
        self._directory = directory
        template = directory / chat_template.TEMPLATE_FILE
        self.template_files = _template_files(
            {template.name: template.read_bytes()} if template.exists() else {}
        )

    def weights(self, tensors: dict[str, names_lib.Tensor], dtype: np.dtype):
        reader = safetensors_files.Reader(self._directory)
        hf_checkpoint.check_tensors(str(self._directory), reader, tensors)
        return ((t.name, reader.read(t.name).astype(dtype)) for t in tensors.values())


def _template_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The chat template among a model's files (``chat_template.jinja``), if any."""
    name = chat_template.TEMPLATE_FILE
    return {name: files[name]} if name in files else {}


def _weights(
    checkpoints: CheckpointReader,
    step: int,
    saved: dict,
    tensors: dict[str, names_lib.Tensor],
    sources: dict[str, stacking.Source],
    dtype: np.dtype,
) -> Iterator[tuple[str, np.ndarray]]:
    """``(Hugging Face name, array)`` of every tensor, a saved leaf read at a time."""
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
            yield tensor.name, tensor.to_theirs(value if index is None else value[index])
