"""Hugging Face's ``*.safetensors`` files, read a tensor at a time and written in shards.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}``, then the tensors' bytes, row-major, little-endian, at those offsets. A model
of several files lists which holds each tensor in ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {name: file}}``).

Reading parses the headers only, then reads each tensor's bytes when it is asked for:
the host holds one tensor at a time, never a file or the model. Writing appends each
tensor's bytes to a shard as it comes and writes the header when the shard is full
(the data is copied once, behind its header), so it too holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct
from collections.abc import Iterable

import ml_dtypes
import numpy as np

from trainer.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class Entry:
    """Where one tensor lies: its file, dtype, shape and byte range in the file."""

    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def _header(path: str) -> tuple[dict, int]:
    """The JSON header of one file and where its data starts."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(
                f"{path} is not a safetensors file (its header is not JSON)"
            ) from None
    return header, 8 + size


class Reader:
    """The tensors of a model directory's safetensors files, read when asked for.

    Raises (when built):
      ConfigError: no safetensors file, an index naming a file that is missing, or a
        file that is not safetensors.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, INDEX)
        if os.path.exists(index):
            with open(index, encoding="utf-8") as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        elif os.path.exists(os.path.join(self.directory, SINGLE)):
            files = [SINGLE]
        else:
            raise ConfigError(
                f"{self.directory} has no {SINGLE} and no {INDEX}: its weights are not "
                "safetensors files (save the model with save_pretrained(safe_serialization=True))"
            )
        self.entries: dict[str, Entry] = {}
        for name in files:
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise ConfigError(f"{index} names {name}, which is missing: a shard is lost")
            header, start = _header(path)
            for tensor, info in header.items():
                if tensor == "__metadata__":
                    continue
                if info["dtype"] not in _DTYPES:
                    raise ConfigError(f"{path}: tensor {tensor} has dtype {info['dtype']}")
                begin, end = info["data_offsets"]
                self.entries[tensor] = Entry(
                    path, _DTYPES[info["dtype"]], tuple(info["shape"]), start + begin, start + end
                )

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name``, in its file's dtype (bfloat16 as ml_dtypes')."""
        entry = self.entries[name]
        buffer = bytearray(entry.end - entry.begin)
        with open(entry.file, "rb") as f:
            f.seek(entry.begin)
            f.readinto(buffer)
        array = np.frombuffer(buffer, dtype=entry.dtype.newbyteorder("<"))
        return array.reshape(entry.shape)


class _Shard:
    """One shard being written: its tensors' bytes in a data file, their header entries."""

    def __init__(self, path: str):
        self.path, self.header, self.size = path, {}, 0
        self._data = open(path, "wb")  # noqa: SIM115  (closed by finish, or by write's cleanup)

    def add(self, name: str, array: np.ndarray) -> None:
        self.header[name] = {
            "dtype": _NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [self.size, self.size + array.nbytes],
        }
        # Little-endian, as the format says; the bytes written without a copy.
        self._data.write(
            array.astype(array.dtype.newbyteorder("<"), copy=False).view(np.uint8).data
        )
        self.size += array.nbytes

    def close(self) -> None:
        self._data.close()

    def finish(self, out: str) -> None:
        """Writes the shard to ``out``: its header, then its data."""
        self.close()
        body = json.dumps({"__metadata__": {"format": "pt"}, **self.header}).encode()
        body += b" " * (-len(body) % 8)  # the data 8-byte aligned, as the library writes it
        with open(out, "wb") as f, open(self.path, "rb") as data:
            f.write(struct.pack("<Q", len(body)) + body)
            shutil.copyfileobj(data, f, 1 << 24)
        os.remove(self.path)


def write(
    directory: str | os.PathLike,
    tensors: Iterable[tuple[str, np.ndarray]],
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> dict[str, str]:
    """Writes ``tensors`` (name, array; in the order they come) as
    ``model-0000N-of-0000M.safetensors`` shards of at most ``max_shard_bytes`` each (a
    bigger tensor gets a shard of its own) and ``model.safetensors.index.json``.
    Returns the weight map."""
    directory = os.fspath(directory)
    shards: list[_Shard] = []
    try:
        for name, array in tensors:
            array = np.ascontiguousarray(array)
            if not shards or (shards[-1].size and shards[-1].size + array.nbytes > max_shard_bytes):
                if shards:
                    shards[-1].close()
                shards.append(_Shard(os.path.join(directory, f".shard-{len(shards)}.data")))
            shards[-1].add(name, array)
        weight_map = {}
        for i, shard in enumerate(shards):
            name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            shard.finish(os.path.join(directory, name))
            weight_map |= dict.fromkeys(shard.header, name)
    finally:
        for shard in shards:
            shard.close()
    total = sum(shard.size for shard in shards)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, INDEX), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
    return weight_map
