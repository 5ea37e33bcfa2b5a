"""NCF on the embedded implicit-feedback data, end to end through the trainer."""

import json
import os

import pytest

from configs import ncf_16
from trainer.training import train as train_lib


@pytest.mark.slow  # a training run of ~25 s, cold
@pytest.mark.parametrize("mode", ["wus"])
def test_tiny_ncf_learns_to_rank(tmp_path, mode):
    config = ncf_16.get_config("tiny")
    config.data.data_dir = str(tmp_path / "tfds")
    config.update(num_train_steps=200, log_every_steps=100, eval_every_steps=200)
    config.optimizer.update_sharding = mode
    train_lib.train(config, str(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["loss"] < 0.8 * rows[0]["loss"]
    # Random ranking of 1 positive among 100 candidates: HR@10 = 0.1.
    assert rows[-1]["eval/hr@10"] > 0.4
    assert 0 < rows[-1]["eval/ndcg@10"] < rows[-1]["eval/hr@10"]
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "200")
