"""The global order of training rows, and counter-based randomness to build it.

Every pipeline defines one endless, seeded sequence of global training rows
(row r of epoch e is a function of (seed, e, r) alone) and cuts it into global
batches of `global_batch_size` rows. Process p of n takes the contiguous block
`[p * local, (p + 1) * local)` of every global batch, which is where
`jax.make_array_from_process_local_data` puts a process's rows on a mesh whose
data axis follows the process order. So the global batches do not depend on
the number of processes (or on worker processes and threads), and the input
position is one number: the index of the next global batch.

Random numbers come from a counter-based hash of integers (no generator state),
so any row can be computed on its own, vectorised over a batch.
"""

from typing import Any

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_FEISTEL_ROUNDS = 4


def process_rows(batch_index: int, global_batch: int, process_index: int, local_batch: int):
    """Global row numbers (int64 [local_batch]) this process reads for a global batch."""
    first = batch_index * global_batch + process_index * local_batch
    return np.arange(first, first + local_batch, dtype=np.int64)


def hash64(*parts: Any) -> np.ndarray:
    """A uint64 hash of non-negative integer parts (scalars or arrays, broadcast).

    Each part is xored in and followed by the splitmix64 finaliser (a bijective avalanche).
    """
    h = np.asarray(_GOLDEN)
    with np.errstate(over="ignore"):  # Wrapping uint64 arithmetic is intended.
        for part in parts:
            h = h ^ np.asarray(part).astype(np.uint64)
            h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            h = h ^ (h >> np.uint64(31))
    return h


def uniform_below(h: np.ndarray, n: int) -> np.ndarray:
    """Maps uint64 hashes to int64 in [0, n) (n < 2**32) by multiply-shift, bias < n/2**32."""
    return (((h >> np.uint64(32)) * np.uint64(n)) >> np.uint64(32)).astype(np.int64)


def permute(index: np.ndarray, size: int, key: Any) -> np.ndarray:
    """A keyed permutation of [0, size), applied to `index` (int array).

    `key` is a uint64 scalar or one key per element. A 4-round Feistel network
    over the smallest [0, 4**half) >= size, with cycle walking (re-applying it
    until the value falls inside [0, size)) for other sizes: random access into
    a shuffle of any size, without materialising it.
    """
    index = np.asarray(index)
    key = np.broadcast_to(np.asarray(key, np.uint64), index.shape)
    half = max(1, ((size - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)

    def feistel(values: np.ndarray, keys: np.ndarray) -> np.ndarray:
        left, right = values >> np.uint64(half), values & mask
        for round_index in range(_FEISTEL_ROUNDS):
            left, right = right, left ^ (hash64(keys, round_index, right) & mask)
        return (left << np.uint64(half)) | right

    out = feistel(index.astype(np.uint64), key)
    outside = np.flatnonzero(out >= size)
    while outside.size:  # Expected < 4 rounds: [0, 4**half) is less than 4x size.
        out[outside] = feistel(out[outside], key[outside])
        outside = outside[out[outside] >= size]
    return out.astype(np.int64)


def epoch_order(rows: np.ndarray, size: int, seed: int, stream: int) -> tuple[np.ndarray, ...]:
    """(epoch, item) of global rows over epochs of `size` items, reshuffled every epoch."""
    epoch, position = np.divmod(rows, size)
    return epoch, permute(position, size, hash64(seed, stream, epoch))
