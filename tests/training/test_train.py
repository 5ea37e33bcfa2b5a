"""The trainer end to end on the tiny config, and its one-line errors."""

import json
import os
import time

import jax
import numpy as np
import pytest
from conftest import RUNS_LONG, run_command, tiny_command, tiny_translation

from trainer.errors import ConfigError
from trainer.parallel import hardware
from trainer.reporting import metrics as metrics_lib
from trainer.training import experiment
from trainer.training import train as train_lib


def tiny(data_dir, **overrides):
    return tiny_translation(
        data_dir, **{"data.num_eval_examples": 32, "max_decode_length": 16, **overrides}
    )


def read_metrics(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # a training run of 15-40 s
def test_tiny_run_learns_and_reports(data_dir, tmp_path, monkeypatch, capsys):
    config = tiny(
        data_dir, num_train_steps=120, steps_per_loop=20, log_every_steps=20, eval_every_steps=120
    )
    # MFU on CPU only when asked, against a peak measured at the run's start (a fixed
    # figure here, so that the test can check the arithmetic).
    config.measure_cpu_peak = True
    monkeypatch.setattr(hardware, "measure_matmul_peak", lambda dtype: 8e11)
    config.compiler_options = RUNS_LONG  # 120 steps
    train_lib.train(config, str(tmp_path))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [20, 40, 60, 80, 100, 120]
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < 0.7 * first, (first, last)
    for key in ("learning_rate", "examples_per_sec", "tokens_per_sec", "mfu", "steps_per_sec"):
        assert rows[-1][key] > 0, key
    flops = experiment.build_model(config, with_data=False).task.flops_per_example
    assert rows[-1]["mfu"] == pytest.approx(flops * rows[-1]["examples_per_sec"] / 8e11)
    assert "MFU is against 100.0 GFLOP/s per device, this CPU's f32 matmul peak measured" in (
        capsys.readouterr().err
    )
    final = rows[-1]
    assert final["eval/loss"] < first
    assert 0.0 < final["eval/accuracy"] <= 1.0
    assert 0.0 <= final["eval/bleu"] <= 100.0
    assert os.path.exists(tmp_path / "config.json")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path))


@pytest.mark.slow  # training runs of 25-45 s, cold
def test_k_steps_per_loop_equal_single_steps(data_dir, tmp_path):
    states, losses, compiled = [], [], []
    for k in (1, 4):
        config = tiny(
            data_dir, num_train_steps=8, steps_per_loop=k, log_every_steps=4, eval_every_steps=0
        )
        workdir = tmp_path / f"k{k}"
        states.append(
            train_lib.train(config, str(workdir), after_compile=lambda k=k: compiled.append(k))
        )
        losses.append([r["loss"] for r in read_metrics(workdir)])
    # Called after each run's loop and its checkpoint's conversion compile.
    assert compiled == [1, 1, 4, 4]
    assert losses[0] == losses[1]
    for a, b in zip(
        jax.tree.leaves(states[0].params), jax.tree.leaves(states[1].params), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(states[0].step) == int(states[1].step) == 8


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"nonexistent_key": 1}, "unknown config key 'nonexistent_key'"),
        ({"optimizer.bogus": 1}, "unknown config key 'optimizer.bogus'"),
        pytest.param(
            {"global_batch_size": "abc"}, "--config.global_batch_size=abc", marks=pytest.mark.slow
        ),
        ({"global_batch_size": 12}, "global_batch_size=12 is not divisible by the 8"),
        pytest.param(
            {"mesh.axes.model": 3},
            "8 devices are not divisible by the product 3",
            marks=pytest.mark.slow,
        ),
        pytest.param(
            {"data.name": "wmt14_translate/de-en"},
            "tfds build wmt14_translate/de-en",
            marks=pytest.mark.slow,
        ),
        ({"log_every_steps": 7}, "log_every_steps=7 must be a multiple of steps_per_loop"),
        pytest.param(
            {"optimizer.learning_rate": "1e30", "num_train_steps": 40},
            "loss is nan at step",
            marks=pytest.mark.slow,  # 40 steps: ~16 s
        ),
    ],
)
def test_bad_input_is_one_line_error(data_dir, tmp_path, overrides, message):
    result = run_command(tiny_command(tmp_path, data_dir, **overrides))
    assert result.returncode != 0
    lines = [line for line in result.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1, result.stderr[-2000:]
    assert message in lines[0], lines[0]
    assert "Traceback" not in result.stderr


@pytest.mark.slow  # a training run of 15-40 s
def test_loss_growth_is_said_once(data_dir, tmp_path, capsys):
    # A learning rate that diverges to large but finite losses within the first loop.
    config = tiny(
        data_dir,
        num_train_steps=20,
        steps_per_loop=10,
        log_every_steps=10,
        eval_every_steps=0,
        **{"optimizer.learning_rate": 30.0, "optimizer.warmup_steps": 0},
    )
    train_lib.train(config, str(tmp_path))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("warning: the loss grew to "), warnings
    assert all(np.isfinite(row["loss"]) for row in read_metrics(tmp_path))


def test_loss_growth_watch_window_and_padding():
    watch = metrics_lib.LossGrowthWatch(10.0)
    ones = np.ones(5)
    assert watch.observe(0, np.array([5.0, 4.0, 3.0, 2.0, 1.0]), ones) is None
    # Padding-only steps (no weight) are not losses, however small they look.
    assert watch.observe(5, np.array([0.0, 9.0, 0.0]), np.array([0.0, 1.0, 0.0])) is None
    said = watch.observe(8, np.array([2.0, 10.5, 50.0]), np.ones(3))
    assert said.startswith("the loss grew to 10.5 at step 10, 10.5x"), said
    assert "(1 at step 5)" in said
    assert watch.observe(11, np.array([1e6]), np.ones(1)) is None  # once
    # The minimum is that of the last 1000 steps only.
    watch = metrics_lib.LossGrowthWatch(10.0)
    assert watch.observe(0, np.array([0.1]), np.ones(1)) is None
    assert watch.observe(1000, np.array([2.0]), np.ones(1)) is None  # step 1 left the window
    with pytest.raises(ConfigError, match="loss_growth_warning must be > 1"):
        metrics_lib.LossGrowthWatch(0.5)
    assert metrics_lib.LossGrowthWatch(0).observe(0, np.array([1.0, 1e9]), np.ones(2)) is None


@pytest.mark.slow  # training runs of 25-45 s, cold
def test_rows_carry_time_and_window_and_a_resume_row_names_its_window(data_dir, tmp_path, capsys):
    flags = dict(steps_per_loop=2, log_every_steps=4, checkpoint_every_steps=2, eval_every_steps=0)
    train_lib.train(tiny(data_dir, num_train_steps=6, **flags), str(tmp_path))
    capsys.readouterr()
    # A row another tool edited (its step a string) is set aside by the resume, not lost.
    metrics = tmp_path / "metrics.jsonl"
    edited = metrics.read_text().replace('"step": 4', '"step": "4"', 1)
    metrics.write_text(edited)
    damaged = next(line for line in edited.splitlines() if '"step": "4"' in line)
    train_lib.train(tiny(data_dir, num_train_steps=8, **flags), str(tmp_path))
    out = capsys.readouterr().err
    assert (tmp_path / "metrics.unreadable.jsonl").read_text() == damaged + "\n"
    assert (
        f"warning: skipped 1 unreadable line of {metrics} (cut short, not UTF-8, not a JSON "
        "object, or without an integer step); the other rows are used; they are kept in "
        f"{tmp_path / 'metrics.unreadable.jsonl'}"
    ) in out
    rows = read_metrics(tmp_path)
    assert [(r["step"], r["window_steps"]) for r in rows] == [(6, 2), (8, 2)]
    assert not any(k.startswith("eval/") for r in rows for k in r)  # 0: no evaluation at all
    assert "evaluating" not in out and "decoding for BLEU" not in out
    times = [r["time"] for r in rows]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600
    for r in rows:
        assert r["step_time_s"] == pytest.approx(1 / r["steps_per_sec"])
    # The resumed run's first row averages only the steps since its checkpoint: it says so.
    (line,) = [line for line in out.splitlines() if line.startswith("step       8/8 |")]
    assert line.endswith("(over the 2 steps since the resume)")
    assert "; run the same command again to resume" not in out  # it finished
    assert not (tmp_path / "run.lock").exists() and not (tmp_path / "run.lock.peers").exists()
