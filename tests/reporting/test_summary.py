"""The closing summary's hints and file list."""

import importlib.util
import re

from etils import epath

from trainer.reporting import summary


def test_the_tensorboard_hint_says_how_to_install_it_where_it_is_missing(tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    (line, *_) = summary.commands(epath.Path(tmp_path))
    assert (
        line
        == f"tensorboard --logdir {tmp_path}   (not installed: pip install tensorboard==2.21.0)"
    )
    # With metrics to plot and no matplotlib, the plot hint names the extra too.
    (tmp_path / "metrics.jsonl").write_text('{"step": 10, "loss": 1.0}\n')
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name in ("tensorboard", "matplotlib") else real(name, *a),
    )
    plot = summary.commands(epath.Path(tmp_path))[1]
    assert plot.endswith("metrics.png   (needs matplotlib: pip install -e '.[plot]')")
    # The version the project tests its event files with (pyproject.toml's test extra).
    with open(epath.Path(__file__).parents[2] / "pyproject.toml") as f:
        assert re.search(rf'"{re.escape(summary.TENSORBOARD)}"', f.read())
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert summary.commands(epath.Path(tmp_path))[0] == f"tensorboard --logdir {tmp_path}"


def test_files_are_what_a_user_opens(tmp_path):
    for name in ("metrics.jsonl", "config.json", "run.lock", "run.lock.peers", ".hidden"):
        (tmp_path / name).write_text("")
    (tmp_path / "checkpoints").mkdir()
    assert summary.user_files(epath.Path(tmp_path)) == [
        "checkpoints",
        "config.json",
        "metrics.jsonl",
        "summary.json",
    ]
