"""Tests of the MovieLens negative sampler on a hand-made interaction table."""

import numpy as np
import pytest

from trainer.errors import ConfigError
from trainer.input.negatives import NegativeSampler


def test_sampler_rejects_positives_when_few_items_are_free():
    # User 0 has interacted with every item but 3 and 7; user 1 with item 0 only.
    items = np.array([i for i in range(10) if i not in (3, 7)] + [0])
    users = np.array([0] * 8 + [1])
    sampler = NegativeSampler(users, items, num_items=10)
    keys = np.arange(4000, dtype=np.uint64)
    sampled = sampler.sample(np.zeros(4000, np.int64), keys)
    assert set(sampled.tolist()) == {3, 7}
    assert 1500 < (sampled == 3).sum() < 2500
    distinct = sampler.sample_distinct(np.array([0, 1, 0]), 2, keys[:3])
    assert [set(row) for row in distinct.tolist()][::2] == [{3, 7}, {3, 7}]
    assert 0 not in distinct[1] and distinct[1, 0] != distinct[1, 1]
    # A row's negatives are a function of its key alone.
    np.testing.assert_array_equal(
        sampler.sample_distinct(np.array([1]), 2, keys[1:2]), distinct[1:2]
    )
    sampler.check_feasible(2, "toy")
    with pytest.raises(ConfigError, match="lower num_eval_negatives"):
        sampler.check_feasible(3, "toy")
