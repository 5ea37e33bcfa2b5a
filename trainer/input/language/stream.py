"""Documents joined into one token stream, an epoch at a time, cut into rows: which
pieces of which documents global row ``r`` holds, and the rows' arrays."""

from __future__ import annotations

import threading

import numpy as np

from trainer.errors import ConfigError
from trainer.input import packing

_STREAM_SEED = 0  # the training stream's key; eval rows are in file order


class DocumentStream:
    """Global row -> the pieces of documents it holds (thread-safe, picklable).

    Args:
      lengths: each document's tokens (BOS and EOS included).
      row_tokens: tokens a row holds (``L + 1`` for a decoder, ``L`` for masked).
      stride: tokens between rows' starts (``L``).
      seed: of the per-epoch shuffle; None: the documents in order, one epoch.
    """

    def __init__(self, lengths: np.ndarray, row_tokens: int, stride: int, seed: int | None):
        self.lengths = np.asarray(lengths, np.int64)
        self.row_tokens, self.stride, self.seed = row_tokens, stride, seed
        total = int(self.lengths.sum())
        self.rows_per_epoch = max(0, (total - row_tokens) // stride + 1)
        if self.rows_per_epoch < 1:
            raise ConfigError(
                f"the documents hold {total:,} tokens, less than one row of {row_tokens}: "
                "add text or lower data.max_length"
            )
        self.__setstate__({})

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_lock", "_epochs"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._epochs: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(document order, cumulative token counts) of an epoch (the lock is held)."""
        if epoch not in self._epochs:
            n = len(self.lengths)
            if self.seed is None:
                order_ = np.arange(n)
            else:
                order_ = np.random.default_rng((self.seed, _STREAM_SEED, epoch)).permutation(n)
            starts = np.concatenate([[0], np.cumsum(self.lengths[order_])])
            for old in [e for e in self._epochs if e < epoch - 1]:
                del self._epochs[old]
            self._epochs[epoch] = (order_, starts)
        return self._epochs[epoch]

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """``(document, first token, end token)`` of each piece of global row ``row``."""
        epoch, within = divmod(int(row), self.rows_per_epoch)
        if self.seed is None and epoch:
            raise IndexError(f"row {row} is past the {self.rows_per_epoch} rows of the documents")
        with self._lock:
            order_, starts = self._epoch(epoch)
        start = within * self.stride
        stop = start + self.row_tokens
        first = int(np.searchsorted(starts, start, side="right")) - 1
        last = int(np.searchsorted(starts, stop, side="left"))
        return [
            (
                int(order_[j]),
                max(start - int(starts[j]), 0),
                min(stop, int(starts[j + 1])) - int(starts[j]),
            )
            for j in range(first, last)
        ]


class PackedDocuments:
    """Global row -> whole documents (never cut: a conversation with the answers it
    learns), packed first-fit into rows of ``row_tokens`` from a seeded order of them,
    shuffled anew each epoch (:class:`trainer.input.packing.RowPlan`); picklable.

    Args:
      lengths: each document's tokens (at most ``row_tokens``).
      row_tokens: tokens a row holds.
      seed: of the order (the same for every epoch's eval rows: ``None`` -> 0).
    """

    def __init__(self, lengths: np.ndarray, row_tokens: int, seed: int | None):
        self.lengths = np.asarray(lengths, np.int64)
        self.row_tokens = row_tokens
        both = np.stack([self.lengths, np.zeros_like(self.lengths)], axis=1)
        self._plan = packing.RowPlan(both, row_tokens, True, seed or 0, "document")
        self.rows_per_epoch = self._plan.rows_in_epoch(0)

    def pieces(self, row: int) -> list[tuple[int, int, int]]:
        """``(document, 0, its length)`` of each document of global row ``row``."""
        (documents,) = self._plan.rows(np.asarray([row]))
        return [(int(d), 0, int(self.lengths[d])) for d in documents]


def fill_rows(
    rows: list[list[tuple[int, int, int]]],
    tokens: dict[int, np.ndarray],
    width: int,
    masks: dict[int, np.ndarray] | None = None,
):
    """``(tokens, segmentation, positions, counted)`` [rows, width] of rows of pieces:
    int32, and bool ``counted`` True where a token is one the loss learns (every real
    token, or where ``masks``, per document, say so; padding never)."""
    out = [np.zeros((len(rows), width), np.int32) for _ in range(3)]
    counted = np.zeros((len(rows), width), bool)
    for r, pieces in enumerate(rows):
        at = 0
        for segment, (doc, begin, end) in enumerate(pieces, start=1):
            n = end - begin
            out[0][r, at : at + n] = tokens[doc][begin:end]
            out[1][r, at : at + n] = segment
            out[2][r, at : at + n] = np.arange(n)
            counted[r, at : at + n] = True if masks is None else masks[doc][begin:end]
            at += n
    return (*out, counted)
