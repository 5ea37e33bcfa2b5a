"""ResNet on the embedded synthetic images, end to end through the trainer."""

import json

import pytest
from conftest import RUNS_LONG

from configs import resnet50_1024
from trainer.training import train as train_lib


@pytest.mark.slow  # 45 s: a ResNet trained to learn
def test_tiny_resnet_learns(tmp_path):
    # resnet50_16:tiny is this run with BatchNorm over the whole batch; this one also
    # groups BatchNorm statistics (bn_group_size=2), so it covers both configs' code.
    config = resnet50_1024.get_config("tiny")
    config.data.data_dir = str(tmp_path / "tfds")
    config.data.num_eval_examples = 128
    config.update(
        global_batch_size=64,
        num_train_steps=60,
        log_every_steps=20,
        eval_every_steps=60,
        checkpoint_every_steps=0,
        compiler_options=RUNS_LONG,  # 60 steps of convolutions
    )
    state = train_lib.train(config, str(tmp_path / "run"))
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    # 60 steps (the loss falls slowly at first: 1.76 -> 1.66) reach 3.6x chance.
    assert rows[-1]["loss"] < 0.97 * rows[0]["loss"]
    assert rows[-1]["eval/accuracy"] > 0.3  # 10 classes: chance is 0.1
    assert rows[-1]["eval/top5_accuracy"] >= rows[-1]["eval/accuracy"]
    # BatchNorm statistics were trained and are kept in the train state.
    stats = state.model_state["batch_stats"]["stem_bn"]["var"]
    assert float(abs(stats - 1.0).max()) > 1e-3
