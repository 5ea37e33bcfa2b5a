"""Hugging Face's ``*.safetensors`` files, read a tensor at a time and written in shards.

The format (huggingface/safetensors): an 8-byte little-endian header length, a JSON
header ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{...}}``, then the tensors' bytes, row-major, little-endian, at those offsets. A model
of several files lists which holds each tensor in ``model.safetensors.index.json``
(``{"metadata": {"total_size"}, "weight_map": {name: file}}``).

Why not the ``safetensors`` library: it is no dependency of the trainer (only of the
``hf`` extra), its NumPy reader cannot give a bfloat16 tensor (NumPy has no such
dtype: most checkpoints are bfloat16), and its JAX reader places each tensor on an
accelerator, where the import wants host bytes to cut into device blocks; its
writer takes a whole shard's tensors at once. So this module reads and writes the
format itself, and checks what the library checks before a byte is used: a header
that is a JSON object of entries with a known dtype, a shape and offsets whose
length is the shape's bytes, and a file that holds every byte its header names (a
file cut short is refused, never read as zeros).

Reading parses the headers only, then reads each tensor's bytes when it is asked for:
the host holds one tensor at a time, never a file or the model. Writing appends each
tensor's bytes to a shard as it comes and writes the header when the shard is full
(the data is copied once, behind its header), so it too holds one tensor at a time.
"""

from __future__ import annotations

import dataclasses
import json
import math
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

    @property
    def floating(self) -> bool:
        """Whether the tensor is floating-point (a weight's dtype: BF16, F16, F32, F64)."""
        return _NAMES[self.dtype] in ("BF16", "F16", "F32", "F64")


def _header(path: str) -> tuple[dict, int]:
    """The JSON header of one file and where its data starts.

    Raises:
      ConfigError: a file too short for its header, or a header that is not a JSON object.
    """
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ConfigError(f"{path} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        body = f.read(min(size, 100 * 2**20))  # the library's limit on a header, too
        if len(body) != size:
            raise ConfigError(
                f"{path} is cut short: its header says {size:,} bytes of header, the file "
                f"has {len(body):,} after the first 8 (download it again)"
            )
        try:
            header = json.loads(body)
        except (UnicodeDecodeError, ValueError):
            raise ConfigError(
                f"{path} is not a safetensors file (its header is not JSON)"
            ) from None
    if not isinstance(header, dict):
        raise ConfigError(f"{path} is not a safetensors file (its header is not a JSON object)")
    return header, 8 + size


def _entry(path: str, tensor: str, info, start: int) -> Entry:
    """A header's entry ``info`` of ``tensor``, checked: a known dtype, a shape of
    non-negative ints and offsets that span exactly the shape's bytes."""
    where = f"{path}: tensor {tensor}"
    if not isinstance(info, dict):
        raise ConfigError(f"{where}: its header entry is {type(info).__name__}, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _DTYPES:
        raise ConfigError(
            f"{where} has dtype {json.dumps(dtype)}: this reader takes {', '.join(_DTYPES)}"
        )
    if not isinstance(shape, list) or not all(_count(n) for n in shape):
        raise ConfigError(f"{where} has shape {json.dumps(shape)}: not a list of sizes")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_count(n) for n in offsets)
        or offsets[0] > offsets[1]
    ):
        raise ConfigError(f"{where} has data_offsets {json.dumps(offsets)}: not [begin, end]")
    nbytes = math.prod(shape) * _DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise ConfigError(
            f"{where}: its data_offsets {offsets} span {offsets[1] - offsets[0]:,} bytes, "
            f"but a {dtype} tensor of shape {tuple(shape)} has {nbytes:,}"
        )
    return Entry(path, _DTYPES[dtype], tuple(shape), start + offsets[0], start + offsets[1])


def _count(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


def _file_list(directory: str) -> list[str]:
    """The safetensors files of a model directory: those its index names, or the one."""
    index = os.path.join(directory, INDEX)
    if not os.path.exists(index):
        if os.path.exists(os.path.join(directory, SINGLE)):
            return [SINGLE]
        raise ConfigError(
            f"{directory} has no {SINGLE} and no {INDEX}: its weights are not "
            "safetensors files (save the model with save_pretrained(safe_serialization=True))"
        )
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
    except (UnicodeDecodeError, ValueError):
        raise ConfigError(f"{index} is not JSON: download it again") from None
    except (KeyError, TypeError, AttributeError):
        raise ConfigError(f"{index} has no weight_map of tensor names to files") from None
    for name in files:
        if not isinstance(name, str) or os.path.basename(name) != name:
            raise ConfigError(f"{index}: weight_map names {name!r}, not a file of {directory}")
    return files


class Reader:
    """The tensors of a model directory's safetensors files, read when asked for.

    Raises (when built):
      ConfigError: no safetensors file, an index naming a file that is missing, a
        file that is not safetensors, an entry of an unknown dtype or inconsistent
        size, or a file shorter than its header says (a download cut short).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, INDEX)
        self.entries: dict[str, Entry] = {}
        for name in _file_list(self.directory):
            path = os.path.join(self.directory, name)
            if not os.path.exists(path):
                raise ConfigError(f"{index} names {name}, which is missing: a shard is lost")
            header, start = _header(path)
            entries = {
                tensor: _entry(path, tensor, info, start)
                for tensor, info in header.items()
                if tensor != "__metadata__"
            }
            size = os.path.getsize(path)
            end = max((e.end for e in entries.values()), default=start)
            if size < end:
                raise ConfigError(
                    f"{path} is cut short: {size:,} bytes where its header names {end:,} "
                    f"(download it again)"
                )
            self.entries |= entries

    def read(self, name: str) -> np.ndarray:
        """The tensor ``name``, in its file's dtype (bfloat16 as ml_dtypes').

        Raises:
          ConfigError: the file ends before the tensor does (cut since it was opened).
        """
        entry = self.entries[name]
        buffer = bytearray(entry.end - entry.begin)
        with open(entry.file, "rb") as f:
            f.seek(entry.begin)
            got = f.readinto(buffer)
        if got != len(buffer):
            raise ConfigError(
                f"{entry.file} is cut short: tensor {name} needs bytes {entry.begin:,} to "
                f"{entry.end:,}, the file ends at {entry.begin + got:,} (download it again)"
            )
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
