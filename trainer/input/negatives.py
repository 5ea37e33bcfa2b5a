"""Negative sampling for implicit feedback: items a user never interacted with.

Negatives are uniform over the items a user never interacted with (train or eval):
uniform candidates from a counter-based hash of a row's key and an attempt number,
rejected while they hit a positive (binary search in the sorted user * num_items +
item keys). So a negative is a function of its key alone (no generator state),
vectorised over a batch. Training negatives are drawn with replacement; each
user's eval negatives are distinct.
"""

import math
from typing import Any

import numpy as np

from trainer.errors import ConfigError
from trainer.input import order

_SAMPLE_CHUNK = 1 << 22  # Candidates per vectorised round of `sample_distinct`.


class NegativeSampler:
    """Uniform negatives: items a user never interacted with."""

    def __init__(self, users: np.ndarray, items: np.ndarray, num_items: int) -> None:
        """Args: the int user and item ids of every interaction; the number of items."""
        self.num_items = num_items
        keys = np.sort(users.astype(np.int64) * num_items + items)
        # Deduplicated by hand: numpy 2.4's np.unique takes ~50x longer on 20M keys.
        self._keys = keys[np.concatenate([[True], keys[1:] != keys[:-1]])]
        self._degrees = np.bincount(users)

    def check_feasible(self, num_eval_negatives: int, name: str) -> None:
        """Raises ConfigError if some user lacks `num_eval_negatives` (>= 1) free items."""
        short = int((self.num_items - self._degrees < num_eval_negatives).sum())
        if short:
            raise ConfigError(
                f"{short} users of '{name}' have interacted with more than num_items - "
                f"num_eval_negatives = {self.num_items} - {num_eval_negatives} items, leaving "
                "too few negatives; lower num_eval_negatives."
            )

    def is_positive(self, users: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Whether each (user, item) pair is an interaction (arrays broadcast)."""
        keys = np.asarray(users, np.int64) * self.num_items + items  # No int32 overflow.
        found = np.minimum(np.searchsorted(self._keys, keys), len(self._keys) - 1)
        return self._keys[found] == keys

    def _candidate(self, key: np.ndarray, attempt: Any) -> np.ndarray:
        return order.uniform_below(order.hash64(key, attempt), self.num_items)

    def sample(self, users: np.ndarray, key: np.ndarray) -> np.ndarray:
        """One negative per user, a function of its uint64 `key` (same shape as `users`)."""
        items = self._candidate(key, 0)
        rejected = np.flatnonzero(self.is_positive(users, items))
        attempt = 1
        while rejected.size:
            items[rejected] = self._candidate(key[rejected], attempt)
            rejected = rejected[self.is_positive(users[rejected], items[rejected])]
            attempt += 1
        return items

    def sample_distinct(self, users: np.ndarray, count: int, key: np.ndarray) -> np.ndarray:
        """int32 [len(users), count] distinct negatives per user, a function of the row's `key`.

        Row r takes the first `count` distinct non-positive candidates of attempts 0, 1, ...
        of key[r]; rows short of them retry with twice the attempts (same prefix), so the
        result does not depend on chunking. `check_feasible(count)` must hold.
        """
        out = np.empty((len(users), count), np.int32)  # Item ids < 2**31; half the memory.
        todo, width = np.arange(len(users)), 2 * count + 16
        while todo.size:
            short = []
            for chunk in np.array_split(todo, math.ceil(todo.size * width / _SAMPLE_CHUNK)):
                candidates = self._candidate(key[chunk, None], np.arange(width))
                valid = ~self.is_positive(users[chunk, None], candidates)
                # Keep the first occurrence of each item: a stable sort puts it first.
                order = np.argsort(candidates, axis=1, kind="stable")
                ranked = np.take_along_axis(candidates, order, axis=1)
                first = np.ones_like(valid)
                first[:, 1:] = ranked[:, 1:] != ranked[:, :-1]
                np.put_along_axis(valid, order, np.take_along_axis(valid, order, 1) & first, 1)
                done = valid.sum(axis=1) >= count
                take = valid & (np.cumsum(valid, axis=1) <= count)
                out[chunk[done]] = candidates[done][take[done]].reshape(-1, count)
                short.append(chunk[~done])
            todo, width = np.concatenate(short), 2 * width
        return out
