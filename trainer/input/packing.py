"""The global order of translation rows, planned from token lengths alone.

Why a plan: every process must agree on which examples form global row r, for
any process count, without every host tokenizing the whole global stream (at 256
hosts and a 25 ms step that would cost far more than the step). Packing only
needs each example's token counts, so:

  * `token_lengths`: (inputs, targets) token counts, EOS included, of every
    example of the training split, computed once per dataset + split +
    vocabulary and cached next to the vocabulary file (first writer wins, as for
    the vocabulary itself; `python -m trainer.data.prepare` computes it ahead);
  * `RowPlan`: epoch e keeps the examples that fit `max_length`, shuffles them
    with a generator seeded by (seed, e), packs each run of 64 consecutive
    examples first-fit-decreasing into rows (vectorised over all runs at once:
    ~0.5 us an example, ~2 s for WMT's 4.5M pairs) and shuffles the rows. Every
    process (and worker) plans each epoch itself, identically;
  * a process then reads and tokenizes only the examples of its own rows.

Unpacked data is the same plan with one example a row.
"""

import hashlib
import io
import re
import threading
from collections.abc import Callable, Iterable

import numpy as np
from etils import epath

from trainer import console
from trainer.errors import ConfigError

# Examples packed together: bigger packs tighter (~97% of target tokens at 64 on
# tiny_translation, vs 77% for packing in order) but costs O(chunk) per example.
_CHUNK = 64
# Examples tokenized per batched read when computing lengths (and between progress lines).
_LENGTH_CHUNK = 1024


def lengths_path(vocab_path: str, dataset: str, split: str) -> epath.Path:
    """Where the token lengths of `dataset`'s `split` under a vocabulary are cached."""
    vocab = epath.Path(vocab_path)
    digest = hashlib.sha256(vocab.read_bytes()).hexdigest()[:12]
    name = re.sub(r"[^A-Za-z0-9]+", "_", f"{dataset}-{split}").strip("_")
    return vocab.parent / f"{vocab.name}.{digest}.{name}.lengths.npy"


def token_lengths(
    path: epath.Path,
    num_examples: int,
    read: Callable[[Iterable[int]], list],
    count: Callable[[list], Iterable],
    *,
    width: int = 2,
    what: str = "examples",
) -> np.ndarray:
    """int32 [num_examples, width] token counts, loaded from `path` or computed and
    saved there (shared by the translation pairs and a language model's documents).
    Computing them says how far it got every 10 s (a corpus of millions of documents
    takes minutes).

    Args:
      path: the cache file (see `lengths_path`).
      num_examples: examples in the split.
      read: indices -> records.
      count: records -> their counts, ``width`` each (a pair's input and target
        tokens; a document's).
      width: counts per example.
      what: the examples, as the progress lines name them ("documents").
    """
    if path.exists():
        lengths = np.load(io.BytesIO(path.read_bytes()))
        if lengths.shape == (num_examples, width):
            return lengths
    lengths = np.empty((num_examples, width), np.int32)
    desc = f"counting the tokens of {num_examples:,} {what} (once: cached in {path.parent})"
    with console.progress(total=num_examples, desc=desc, unit=what) as done:
        for start in range(0, num_examples, _LENGTH_CHUNK):
            indices = range(start, min(num_examples, start + _LENGTH_CHUNK))
            lengths[start : start + len(indices)] = np.reshape(count(read(indices)), (-1, width))
            done.update(len(indices))
    buffer = io.BytesIO()
    np.save(buffer, lengths)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{np.random.default_rng().integers(1 << 62)}.tmp"
    tmp.write_bytes(buffer.getvalue())
    # Atomic, and overwriting: processes that computed the lengths at the same time
    # hold identical bytes (epath's `rename` would refuse an existing file).
    tmp.replace(path)
    return lengths


def first_fit_chunks(lengths: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """First-fit-decreasing packing of consecutive chunks of examples, all chunks at once.

    Each chunk of `_CHUNK` examples (in the given order) is sorted by decreasing
    length and packed first-fit into its own rows: one vectorised step per position in
    the chunk, over every chunk at once (numpy does the O(N x open rows) work).

    Args:
      lengths: int [N, 2] token counts (inputs, targets); each example fits alone.
      max_length: row length.

    Returns:
      (position, starts): row j holds examples position[starts[j]:starts[j+1]]
      (indices into `lengths`), rows chunk after chunk.
    """
    num = len(lengths)
    chunks = -(-num // _CHUNK)
    index = np.full(chunks * _CHUNK, -1, np.int64)  # -1: padding of the last chunk.
    index[:num] = np.arange(num)
    index = index.reshape(chunks, _CHUNK)
    size = np.where(index >= 0, lengths.max(axis=1)[index], 0)
    index = np.take_along_axis(index, np.argsort(-size, axis=1, kind="stable"), axis=1)
    # Per stream (inputs, targets): [chunks, C] token counts, and room left in each row.
    parts = [np.where(index >= 0, lengths[:, k][index], 0).astype(np.int32) for k in (0, 1)]
    room = [np.full((chunks, _CHUNK), max_length, np.int32) for _ in (0, 1)]
    open_rows = np.zeros(chunks, np.int64)
    assigned = np.zeros((chunks, _CHUNK), np.int64)
    every = np.arange(chunks)
    for j in range(_CHUNK):
        width = int(open_rows.max()) + 1  # Rows past every chunk's last open row are empty.
        fits = room[0][:, :width] >= parts[0][:, j, None]
        fits &= room[1][:, :width] >= parts[1][:, j, None]
        row = fits.argmax(axis=1)  # The first row with room (an empty one always has).
        assigned[:, j] = row
        room[0][every, row] -= parts[0][:, j]
        room[1][every, row] -= parts[1][:, j]
        np.maximum(open_rows, row + 1, out=open_rows)
    first_row = np.concatenate([[0], np.cumsum(open_rows)[:-1]])
    global_row = (first_row[:, None] + assigned).ravel()
    real = index.ravel() >= 0
    global_row, position = global_row[real], index.ravel()[real]
    by_row = np.argsort(global_row, kind="stable")
    starts = np.concatenate([[0], np.cumsum(np.bincount(global_row, minlength=open_rows.sum()))])
    return position[by_row], starts


class RowPlan:
    """Global row number -> example indices of the row (thread-safe, picklable)."""

    def __init__(self, lengths: np.ndarray, max_length: int, pack: bool, seed: int, name: str):
        """Args: token lengths [N, 2]; max_length; pack; the order's seed; a name for errors."""
        self.kept = np.flatnonzero((lengths <= max_length).all(axis=1))
        if not self.kept.size:
            raise ConfigError(
                f"No {name} training pair fits max_length={max_length} "
                f"(the shortest needs {int(lengths.max(axis=1).min())}); raise max_length."
            )
        self.lengths, self.max_length, self.pack, self.seed = lengths, max_length, pack, seed
        self._first_rows = [0]  # _first_rows[e]: global row where epoch e starts.
        self._plans: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.__setstate__({})

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_lock", "_pending", "_ready"):
            del state[key]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._pending: dict[int, threading.Thread] = {}
        self._ready: dict[int, tuple] = {}

    def _compute(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(examples, row starts, row order) of an epoch: row j of the epoch holds
        examples[starts[order[j]] : starts[order[j] + 1]]."""
        rng = np.random.default_rng((self.seed, epoch))
        examples = self.kept[rng.permutation(len(self.kept))]
        if not self.pack:
            return examples, np.arange(len(examples) + 1), np.arange(len(examples))
        position, starts = first_fit_chunks(self.lengths[examples], self.max_length)
        # Rows in random order: a chunk's first rows hold its longest examples.
        return examples[position], starts, rng.permutation(len(starts) - 1)

    def _plan(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan of an epoch (the lock is held); the next one is computed meanwhile
        on a thread, so a new epoch does not stall the input (~2 s for WMT)."""
        if epoch not in self._plans:
            pending = self._pending.pop(epoch, None)
            if pending is not None:
                pending.join()
                self._plans[epoch] = self._ready.pop(epoch)
            else:
                self._plans[epoch] = self._compute(epoch)
            # Keep this epoch and the next (positions may also jump back: set_state).
            for old in [e for e in self._plans if e not in (epoch, epoch + 1)]:
                del self._plans[old]
        following = epoch + 1
        if following not in self._plans and following not in self._pending:
            thread = threading.Thread(
                target=lambda: self._ready.__setitem__(following, self._compute(following)),
                daemon=True,
            )
            thread.start()
            self._pending[following] = thread
        return self._plans[epoch]

    def rows_in_epoch(self, epoch: int) -> int:
        """How many rows epoch ``epoch`` holds."""
        with self._lock:
            return len(self._plan(epoch)[1]) - 1

    def rows(self, global_rows: np.ndarray) -> list[np.ndarray]:
        """The example indices of each global row, in packing order."""
        out = []
        with self._lock:
            for row in global_rows.tolist():
                while row >= self._first_rows[-1]:  # Plan epochs up to this row's.
                    epoch = len(self._first_rows) - 1
                    self._first_rows.append(self._first_rows[-1] + len(self._plan(epoch)[1]) - 1)
                epoch = int(np.searchsorted(self._first_rows, row, side="right")) - 1
                examples, starts, rows = self._plan(epoch)
                j = rows[row - self._first_rows[epoch]]
                out.append(examples[starts[j] : starts[j + 1]])
        return out
