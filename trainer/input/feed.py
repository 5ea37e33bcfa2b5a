"""Feeding batches: this process's training batches by global index, and eval shares.

A pipeline supplies `batch_fn(b)`: this process's rows of global batch `b`, a
pure function of `b` (see `trainer.input.order`). `TrainBatches` turns it into
an endless iterator whose position is `{"global_batch": b}`, the same number on
every process, valid for any process count and any number of workers.

Worker processes (grain `mp_prefetch`) each compute whole batches, worker w
batches w, w + W, ..., and grain hands them out round-robin, so the batches are
the same with 0, 1 or 8 workers. Batches are built whole (not batched from
examples after the workers) because grain slices a dataset across workers
before batching: per-example work split across workers would regroup rows.
"""

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import grain
import numpy as np
from absl import flags

from trainer.errors import ConfigError
from trainer.input.options import DataOptions

Batch = dict[str, np.ndarray]
# In-process reading (worker_count = 0) uses a couple of threads: decoders and
# tokenizers release the GIL only in part, and XLA needs the other cores.
IN_PROCESS_THREADS = 2
_ENDLESS = 1 << 50  # Global batches of the "endless" iterator.


class TrainBatches(Iterator[Batch]):
    """This process's training batches of global batches n, n+1, ... (endless).

    The position is one global number; `set_state` restarts the reader (and its
    workers) there.
    """

    def __init__(self, batch_fn: Callable[[int], Batch], opts: DataOptions):
        """Args: `batch_fn(b)` -> this process's rows of global batch b; the options."""
        self._batch_fn, self._opts = batch_fn, opts
        self._workers = opts.worker_count
        self._buffer = opts.worker_buffer_size
        self._position = 0
        self._iterator: Any = None

    def with_workers(self, worker_count: int) -> "TrainBatches":
        """A new iterator from batch 0 over the same batches, read by `worker_count` workers."""
        other = TrainBatches(self._batch_fn, self._opts)
        other._workers = worker_count
        return other

    def __iter__(self) -> "TrainBatches":
        return self

    def __next__(self) -> Batch:
        if self._iterator is None:
            self._iterator = iter(self._dataset(self._position))
        batch = next(self._iterator)
        self._position += 1
        return batch

    def get_state(self) -> dict[str, int]:
        """The input position: the global index of the next batch."""
        return {"global_batch": self._position}

    def set_state(self, state: dict[str, Any]) -> None:
        """Continues from a position returned by `get_state` (by any process count)."""
        if set(state) != {"global_batch"} or int(state["global_batch"]) < 0:
            raise ConfigError(f"Not an input position of this trainer: {state!r}.")
        self.close()
        self._position = int(state["global_batch"])

    def close(self) -> None:
        """Stops the reader's threads or worker processes (started again on `next`)."""
        if self._iterator is not None and hasattr(self._iterator, "close"):
            self._iterator.close()
        self._iterator = None

    def _dataset(self, first: int) -> grain.IterDataset:
        batches = grain.MapDataset.range(first, _ENDLESS).map(self._batch_fn)
        if self._workers == 0:
            read = grain.ReadOptions(
                num_threads=IN_PROCESS_THREADS, prefetch_buffer_size=self._buffer
            )
            return batches.to_iter_dataset(read)
        if not flags.FLAGS.is_parsed():
            # grain reads its absl flags when it starts workers; outside an absl app
            # (tests, notebooks) their defaults apply.
            flags.FLAGS.mark_as_parsed()
        # One batch at a time inside a worker: the workers are the parallelism.
        read = grain.ReadOptions(num_threads=1, prefetch_buffer_size=1)
        workers = grain.MultiprocessingOptions(
            num_workers=self._workers, per_worker_buffer_size=self._buffer
        )
        return batches.to_iter_dataset(read).mp_prefetch(workers)


@dataclasses.dataclass(frozen=True)
class Feed:
    """The training batches of this process as the K-step loop takes them: K at a
    time, placed on the devices by ``to_global``, each time with the input position
    after them (what the checkpoint of that loop must store to resume exactly).

    Attributes:
      train_data: this process's :class:`TrainBatches`.
      to_global: stacked local rows ``[K, rows, ...]`` -> global arrays.
    """

    train_data: TrainBatches
    to_global: Callable[[Batch], Any]

    def next(self, k: int) -> tuple[Any, dict]:
        """``(k stacked global batches, the input position after them)``."""
        local = [next(self.train_data) for _ in range(k)]
        stacked = {key: np.stack([b[key] for b in local]) for key in local[0]}
        return self.to_global(stacked), self.position

    @property
    def position(self) -> dict:
        """The input position of the next batch."""
        return self.train_data.get_state()

    def seek(self, position: dict) -> None:
        """Continues from ``position`` (a global one: valid for any process count)."""
        self.train_data.set_state(position)

    def close(self) -> None:
        """Stops the input's worker processes."""
        self.train_data.close()


@dataclasses.dataclass(frozen=True)
class EvalShare:
    """This process's share of the first `total` eval examples, in padded batches.

    Process p owns examples p, p + n, ...; every process runs the same number of
    batches (sized by the largest share), so collective eval steps line up; the
    rows past a process's share are padding (all zero, weight 0).

    Attributes:
      indices: example indices of this process's share, in order.
      num_batches: eval batches every process yields.
      batch: rows per batch (the local batch).
    """

    indices: np.ndarray
    num_batches: int
    batch: int

    @classmethod
    def of(cls, total: int, opts: DataOptions) -> "EvalShare":
        """The share of process `opts.process_index` of `total` examples."""
        largest = math.ceil(total / opts.process_count)
        return cls(
            indices=np.arange(opts.process_index, total, opts.process_count),
            num_batches=math.ceil(largest / opts.local_batch),
            batch=opts.local_batch,
        )

    def batch_indices(self) -> Iterator[np.ndarray]:
        """Per batch, the example indices of its real rows (fewer than `batch` at the end)."""
        for start in range(0, self.num_batches * self.batch, self.batch):
            yield self.indices[start : start + self.batch]


class Counted(Iterator):
    """An iterator that knows how many items it yields, so a progress bar shows a total."""

    def __init__(self, items: Iterator, length: int):
        self._items, self._length = items, length

    def __next__(self):
        return next(self._items)

    def __len__(self) -> int:
        return self._length


def pad_rows(batch: Batch, rows: int) -> Batch:
    """Pads every array of `batch` with zero rows up to `rows` rows."""
    return {
        key: np.pad(value, [(0, rows - len(value))] + [(0, 0)] * (value.ndim - 1))
        for key, value in batch.items()
    }
