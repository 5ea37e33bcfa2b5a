"""Checkpoints: exact resume, resharding on restore, preemption and faults."""

import glob
import json
import os
import shutil
import signal
import time

import jax
import numpy as np
import pytest
from conftest import start_command, tiny_command, tiny_translation

from trainer import checkpoint as checkpoint_lib
from trainer.checkpoint import checkpointer as checkpointer_module
from trainer.training import experiment
from trainer.training import step as step_lib
from trainer.training import train as train_lib


def tiny(data_dir, **overrides):
    return tiny_translation(
        data_dir,
        **{
            "data.num_eval_examples": 16,
            "max_decode_length": 8,
            "num_train_steps": 20,
            "steps_per_loop": 5,
            "log_every_steps": 5,
            "eval_every_steps": 0,
            "checkpoint_every_steps": 10,
            **overrides,
        },
    )


def logical_params(exp, state):
    with jax.set_mesh(exp.mesh):
        return jax.tree.map(np.asarray, exp.to_logical(state).params)


def assert_trees_equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def saved_run(data_dir, tmp_path_factory):
    """A 20-step wus run on 8 devices with checkpoints at steps 10 and 20."""
    workdir = str(tmp_path_factory.mktemp("run"))
    config = tiny(data_dir)
    state = train_lib.train(config, workdir)
    return workdir, logical_params(experiment.build(config), state)


@pytest.mark.slow  # runs end to end: 15-36 s (the LM resume test stays in the default suite)
def test_resumed_run_equals_uninterrupted_run(data_dir, saved_run, tmp_path):
    workdir, final = saved_run
    # Stop at step 10 (as if preempted), then resume to 20 in the same workdir.
    train_lib.train(tiny(data_dir, num_train_steps=10), str(tmp_path))
    config = tiny(data_dir)
    resumed = train_lib.train(config, str(tmp_path))
    assert_trees_equal(logical_params(experiment.build(config), resumed), final)

    def losses(d):
        with open(os.path.join(d, "metrics.jsonl")) as f:
            return [
                line
                for line in f.read().splitlines()
                if '"step": 15' in line or '"step": 20' in line
            ]

    def loss_values(d):
        return [line.split('"loss": ')[1].split(",")[0] for line in losses(d)]

    assert loss_values(tmp_path) == loss_values(workdir)


@pytest.mark.parametrize(
    "overrides",
    [
        {"mesh.num_devices": 4},
        {"mesh.num_devices": 4, "mesh.axes.data": 2, "mesh.axes.model": 2},
        {"mesh.num_devices": 1},
        {"optimizer.update_sharding": "none"},
        {"optimizer.update_sharding": "fsdp"},
    ],
)
@pytest.mark.slow  # a saved run and five restores: ~45 s, cold
def test_restore_reshards(data_dir, saved_run, overrides):
    workdir, final = saved_run
    config = tiny(data_dir, **overrides)
    exp = experiment.build(config)
    step, logical, _ = checkpoint_lib.Checkpointer(workdir, keep=3).restore(exp.logical_state)
    assert step == 20
    state = exp.from_logical(step_lib.TrainState(**logical))
    assert state.params is not None
    for leaf, sharding in zip(
        jax.tree.leaves(state.params), jax.tree.leaves(exp.state_shardings.params), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
    assert_trees_equal(logical_params(exp, state), final)


@pytest.mark.slow  # runs end to end: 15-36 s (the LM resume test stays in the default suite)
def test_restore_from_none_into_wus(data_dir, tmp_path):
    config = tiny(data_dir, num_train_steps=10, **{"optimizer.update_sharding": "none"})
    state = train_lib.train(config, str(tmp_path))
    expected = logical_params(experiment.build(config), state)
    exp = experiment.build(tiny(data_dir))
    _, logical, _ = checkpoint_lib.Checkpointer(str(tmp_path), keep=3).restore(exp.logical_state)
    assert_trees_equal(
        logical_params(exp, exp.from_logical(step_lib.TrainState(**logical))), expected
    )


@pytest.mark.slow  # on the module's saved run (~30 s to make, cold)
def test_shape_mismatch_names_the_parameter(data_dir, saved_run):
    workdir, _ = saved_run
    exp = experiment.build(tiny(data_dir, **{"model.mlp_dim": 128}))
    with pytest.raises(
        checkpoint_lib.CheckpointMismatchError, match=r"mlp/wi/bias has shape \(2, 256\)"
    ):
        checkpoint_lib.Checkpointer(workdir, keep=3).restore(exp.logical_state)


@pytest.mark.slow  # on the module's saved run (~30 s to make, cold)
def test_corrupted_checkpoint_is_moved_aside(data_dir, saved_run, tmp_path, capsys):
    workdir = str(tmp_path / "copy")
    shutil.copytree(saved_run[0], workdir)
    exp = experiment.build(tiny(data_dir))
    # Truncate every data file of the newest state.
    for path in glob.glob(
        os.path.join(workdir, "checkpoints", "20", "state", "**", "*"), recursive=True
    ):
        if os.path.isfile(path) and os.path.getsize(path) > 64:
            with open(path, "r+b") as f:
                f.truncate(16)
    # A reader of that one checkpoint (evaluate, translate, export) gets one error naming it.
    reader = checkpoint_lib.CheckpointReader(workdir)
    with pytest.raises(
        checkpoint_lib.CheckpointError, match=r"checkpoint 20 in .* is unreadable \("
    ) as e:
        reader.restore_state_parts(20, {"params": exp.logical_state.params})
    assert not isinstance(e.value, checkpoint_lib.CheckpointMismatchError)
    step, _, _ = checkpoint_lib.Checkpointer(workdir, keep=3).restore(exp.logical_state)
    assert step == 10
    err = capsys.readouterr().err
    assert "checkpoint 20 is unreadable" in err and "moved it to" in err
    corrupt = os.path.join(workdir, "checkpoints", "corrupt")
    assert [name.split("-")[0] for name in os.listdir(corrupt) if name != "README"] == ["20"]
    assert not os.path.exists(os.path.join(workdir, "checkpoints", "20"))  # step 20 is free
    # Nothing readable left: both are set aside and the run would start afresh.
    shutil.rmtree(os.path.join(workdir, "checkpoints", "10", "state"))
    assert checkpoint_lib.Checkpointer(workdir, keep=3).restore(exp.logical_state) is None
    assert sorted(n.split("-")[0] for n in os.listdir(corrupt) if n != "README") == ["10", "20"]
    assert checkpoint_lib.CheckpointReader(workdir).steps() == []


def _start(workdir, data_dir, **overrides):
    """A run from the command line that goes on until stopped; its output read as it comes."""
    command = tiny_command(
        workdir,
        data_dir,
        **{
            "num_train_steps": 100000,
            "steps_per_loop": 5,
            "log_every_steps": 5,
            "eval_every_steps": 0,
            **overrides,
        },
    )
    return start_command(command)


def _wait_for(proc, text, timeout=240):
    deadline = time.time() + timeout
    lines = []
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if text in line:
            return lines
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"never saw {text!r}:\n{''.join(lines)[-3000:]}")


@pytest.mark.slow  # fault injection on a run end to end
def test_sigterm_saves_and_exits_zero(data_dir, tmp_path):
    proc = _start(str(tmp_path), data_dir, checkpoint_every_steps=0)
    _wait_for(proc, "step      10/")
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-2000:]
    assert "preempted: saved step" in out
    steps = checkpoint_lib.CheckpointReader(str(tmp_path)).steps()
    assert len(steps) == 1 and steps[0] >= 10 and steps[0] % 5 == 0


@pytest.mark.slow  # fault injection on a run end to end
def test_sigkill_during_save_leaves_only_complete_checkpoints(data_dir, tmp_path):
    proc = _start(str(tmp_path), data_dir, checkpoint_every_steps=5)
    _wait_for(proc, "step      10/")
    # Kill while a save is being written after one completed, if one can be caught
    # in the act (on a busy machine the first save may still be in flight here).
    deadline = time.time() + 60
    while time.time() < deadline and not (
        glob.glob(str(tmp_path / "checkpoints" / "*tmp*"))
        and glob.glob(str(tmp_path / "checkpoints" / "*" / "commit_success.txt"))
    ):
        time.sleep(0.005)
    proc.kill()
    proc.communicate()
    steps = checkpoint_lib.CheckpointReader(str(tmp_path)).steps()
    assert steps, "no complete checkpoint"
    for step in steps:
        assert os.path.exists(tmp_path / "checkpoints" / str(step) / "commit_success.txt")
    exp = experiment.build(tiny(data_dir))
    restored_step, _, _ = checkpoint_lib.Checkpointer(str(tmp_path), keep=3).restore(
        exp.logical_state
    )
    assert restored_step == steps[-1]


@pytest.mark.slow  # on the module's saved run (~30 s to make, cold)
def test_export_writes_plain_params(data_dir, saved_run, tmp_path):
    import orbax.checkpoint as ocp

    from trainer.inference import export

    workdir, final = saved_run
    assert export.export(workdir, str(tmp_path / "params"), dtype="bfloat16")[0] == 20
    params = ocp.StandardCheckpointer().restore(str(tmp_path / "params"))
    assert isinstance(params, dict)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(final), strict=True):
        assert got.dtype == jax.numpy.bfloat16
        np.testing.assert_array_equal(np.asarray(got), want.astype(jax.numpy.bfloat16))


@pytest.mark.slow  # runs end to end: 15-36 s (the LM resume test stays in the default suite)
def test_nonfinite_checkpoint_is_moved_aside_and_the_restart_said(
    data_dir, tmp_path, monkeypatch, capsys
):
    workdir = str(tmp_path)
    # A trainer that did not check its saves: a NaN learning rate, the only checkpoint
    # (keep_checkpoints=1) of step 1 saved with NaN weights, then the loss of step 2 is NaN.
    nan_run = tiny(
        data_dir,
        num_train_steps=4,
        steps_per_loop=1,
        log_every_steps=1,
        checkpoint_every_steps=1,
        keep_checkpoints=1,
        **{"optimizer.learning_rate": float("nan")},
    )
    with monkeypatch.context() as unchecked:
        unchecked.setattr(checkpointer_module, "first_nonfinite", lambda tree: None)
        with pytest.raises(train_lib.NonFiniteLossError, match="at step 2"):
            train_lib.train(nan_run, workdir)
    assert checkpoint_lib.CheckpointReader(workdir).steps() == [1]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        earlier = f.read()
    assert [json.loads(line)["step"] for line in earlier.splitlines()] == [1]
    capsys.readouterr()

    # The next run moves it aside, says that it starts from step 0, keeps the rows.
    train_lib.train(tiny(data_dir, num_train_steps=2, steps_per_loop=1, log_every_steps=1), workdir)
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning:" in line]
    corrupt = os.path.join(workdir, "checkpoints", "corrupt")
    moved = sorted(os.listdir(corrupt))
    assert [name.split("-")[0] for name in moved] == ["1", "README", "metrics"], moved
    assert len(warnings) == 2, warnings
    assert warnings[0].startswith(
        "warning: checkpoint 1 holds non-finite values (params/"
    ) and warnings[0].endswith("; there is no older one")
    kept = os.path.join(corrupt, next(n for n in moved if n.startswith("metrics")))
    assert warnings[1] == (
        f"warning: no usable checkpoint is left in {workdir}/checkpoints: this run starts "
        f"from step 0; the earlier metrics.jsonl is kept as {kept}"
    )
    with open(kept) as f:
        assert f.read() == earlier
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2]
    assert checkpoint_lib.CheckpointReader(workdir).steps() == [2]
