"""Fault injection through the command line: kills, signals, a full disk and broken
checkpoints at deterministic points (``WUS_FAULT``, see trainer/faults.py), each
followed by a resume; the resumed runs' losses equal an uninterrupted run's.

Each test is a chain of runs in one work directory (each run resumes what the
previous one left), so a few runs cover many faults; the randomized version is
``scripts/soak.py``.
"""

import glob
import json
import os
import shutil
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import COMPILATION_CACHE, run_command, start_command, tiny_command

STEPS = 8  # 4 loops of 2 steps, a checkpoint after each


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The data directory and a compilation cache shared by every run here."""
    root = tmp_path_factory.mktemp("faults")
    return str(root / "tfds"), COMPILATION_CACHE


def command(shared, workdir, **overrides) -> list[str]:
    """``python -m trainer`` as a user types it: 4 loops of 2 steps, a checkpoint after each."""
    data_dir, cache = shared
    return tiny_command(
        workdir,
        data_dir,
        **{
            "compilation_cache_dir": cache,
            "num_train_steps": STEPS,
            "steps_per_loop": 2,
            "log_every_steps": 2,
            "eval_every_steps": 0,
            "checkpoint_every_steps": 2,
            "data.num_eval_examples": 16,
            "max_decode_length": 8,
            **overrides,
        },
    )


def run(shared, workdir, fault=None, *, timeout=300, **overrides):
    """:func:`command` run to its end, with ``WUS_FAULT=fault``."""
    return run_command(
        command(shared, workdir, **overrides),
        timeout=timeout,
        **({"WUS_FAULT": fault} if fault else {}),
    )


def losses(workdir) -> dict[int, float]:
    """``{step: loss}`` from metrics.jsonl, each step logged exactly once."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    steps = [row["step"] for row in rows]
    assert len(steps) == len(set(steps)), f"repeated rows: {steps}"
    return {row["step"]: row["loss"] for row in rows}


def steps(workdir) -> list[str]:
    """The entries of ``checkpoints/`` (complete steps, temporary directories, corrupt/)."""
    directory = os.path.join(workdir, "checkpoints")
    return sorted(os.listdir(directory)) if os.path.isdir(directory) else []


def clean(result) -> str:
    """The run's output, after checking it has no traceback and no temporary directory."""
    out = result.stdout + result.stderr
    assert "Traceback" not in out, out[-3000:]
    return out


def summary(workdir) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def no_temporary(workdir) -> None:
    assert not glob.glob(os.path.join(workdir, "checkpoints", "*tmp*")), steps(workdir)


@pytest.fixture(scope="module")
def reference(shared, tmp_path_factory):
    """The losses of the uninterrupted run."""
    workdir = tmp_path_factory.mktemp("reference")
    result = run(shared, workdir)
    assert result.returncode == 0, clean(result)[-3000:]
    expected = losses(workdir)
    assert sorted(expected) == [2, 4, 6, 8]
    return expected


@pytest.mark.soak
def test_kills_and_signals_then_resume_equal_uninterrupted_run(shared, reference, tmp_path):
    workdir = str(tmp_path)
    # kill -9 while compiling: nothing saved.
    result = run(shared, workdir, "compile:kill")
    assert result.returncode == -9
    assert steps(workdir) == []
    assert summary(workdir)["status"] == "running"  # never an earlier run's summary
    # kill -9 in the middle of the second save (step 4, its temporary directory written).
    result = run(shared, workdir, "save:kill:2")
    assert result.returncode == -9
    assert steps(workdir) == ["2", "4.orbax-checkpoint-tmp"]
    # SIGTERM while a loop runs: resumes from 2, saves 4 and exits 0; the cut save is removed.
    result = run(shared, workdir, "loop:term")
    out = clean(result)
    assert result.returncode == 0, out[-3000:]
    assert "took over the work directory lock of a run that is no longer running" in out
    assert "resumed from the checkpoint of step 2" in out
    assert "preempted: saved step 4; newest complete checkpoint: step 4" in out
    assert steps(workdir) == ["2", "4"]
    # Ctrl-C twice while saving step 6: the save is abandoned, nothing half-written is left.
    result = run(shared, workdir, "save:int2")
    out = clean(result)
    assert result.returncode == 130, out[-3000:]
    assert (
        "stopped now (Ctrl-C twice): abandoned the save of step 6; newest complete "
        "checkpoint: step 4" in out
    )
    # Never listed; the next run (holding the lock) removes what its writers left.
    assert steps(workdir) in (["2", "4"], ["2", "4", "6.orbax-checkpoint-tmp"])
    # Ctrl-C during the final evaluation: finishes the loop, saves 8 and exits 130.
    result = run(shared, workdir, "eval:int", eval_every_steps=8)
    out = clean(result)
    assert result.returncode == 130, out[-3000:]
    assert "interrupted (Ctrl-C): saved step 8; newest complete checkpoint: step 8" in out
    assert "; run the same command again to resume" in out
    no_temporary(workdir)
    assert losses(workdir) == reference
    # Resumed past num_train_steps, with a compilation cache that cannot be written: both
    # said in one warning each (the cache is not named as in use), nothing trained.
    blocked = os.path.join(workdir, "config.json", "cache")  # a directory inside a file
    result = run(shared, workdir, num_train_steps=4, compilation_cache_dir=blocked)
    out = clean(result)
    assert result.returncode == 0, out[-3000:]
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 2, out[-3000:]
    assert warnings[0].startswith(f"warning: compilation_cache_dir {blocked} cannot be written")
    assert warnings[1] == (
        "warning: the checkpoint of step 8 is past num_train_steps=4: nothing to train "
        "(raise --config.num_train_steps to train on)"
    )
    assert "compilation cache:" not in out
    assert losses(workdir) == reference


@pytest.mark.soak  # fault injection on a run end to end
def test_nonfinite_weights_are_never_saved(shared, tmp_path):
    # A NaN learning rate: the loss of step 1 is finite, the weights after it are not.
    workdir = str(tmp_path)
    result = run(
        shared,
        workdir,
        steps_per_loop=1,
        log_every_steps=1,
        checkpoint_every_steps=1,
        **{"optimizer.learning_rate": "nan"},
    )
    out = clean(result)
    assert result.returncode == 1, out[-3000:]
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: the train state after step 1 is not finite (params/"), error
    assert "nothing was saved" in error
    assert f"no complete checkpoint in {workdir}" in out
    assert steps(workdir) == []


@pytest.mark.soak
def test_full_disk_and_broken_checkpoints_then_resume_equal_uninterrupted_run(
    shared, reference, tmp_path
):
    workdir = str(tmp_path)
    checkpoints = os.path.join(workdir, "checkpoints")
    # A full disk at the second save: one error line, as soon as the next loop ends.
    result = run(shared, workdir, "save:enospc:2")
    out = clean(result)
    assert result.returncode == 1, out[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "saving the checkpoint of step 4" in errors[0], out[-3000:]
    assert "No space left on device" in errors[0]
    failed = summary(workdir)
    assert failed["status"] == "failed" and "No space left on device" in failed["error"]
    assert steps(workdir) == ["2"]
    # An empty directory of step 4 (a save cut short by hand): moved aside, 4 is saved again.
    os.mkdir(os.path.join(checkpoints, "4"))
    result = run(shared, workdir)
    out = clean(result)
    assert result.returncode == 0, out[-3000:]
    assert "warning: checkpoint 4 is unreadable" in out
    assert "resumed from the checkpoint of step 2" in out
    assert steps(workdir) == ["4", "6", "8", "corrupt"]
    # Truncated arrays in the newest checkpoint, no input position in the one before.
    for path in glob.glob(os.path.join(checkpoints, "8", "state", "ocdbt.process_0", "d", "*")):
        os.truncate(path, 16)
    os.remove(os.path.join(checkpoints, "6", "data", "position.json"))
    shutil.copytree(workdir, str(tmp_path / "export_copy"))  # for the export test below
    result = run(shared, workdir)
    out = clean(result)
    assert result.returncode == 0, out[-3000:]
    assert "warning: checkpoint 8 is unreadable" in out
    assert "warning: checkpoint 6 is unreadable" in out
    assert "resumed from the checkpoint of step 4" in out
    moved = sorted(name.split("-")[0] for name in os.listdir(os.path.join(checkpoints, "corrupt")))
    assert moved == ["4", "6", "8", "README"]
    assert losses(workdir) == reference

    # A resume with another optimizer is refused, by name, and config.json is kept.
    with open(os.path.join(workdir, "config.json")) as f:
        config_json = f.read()
    result = run(shared, workdir, **{"optimizer.name": "sgd"})
    out = clean(result)
    assert result.returncode == 1
    assert (
        result.stderr.strip().splitlines()[-1].startswith("error: checkpoint 8 in")
        and "saved with optimizer adam and this run uses sgd" in result.stderr
    ), out[-3000:]
    with open(os.path.join(workdir, "config.json")) as f:
        assert f.read() == config_json
    assert steps(workdir) == ["4", "6", "8", "corrupt"]  # nothing called unreadable

    # trainer.export of the truncated checkpoint: one line, and --out must be new.
    def export(*args):
        copy = str(tmp_path / "export_copy")
        return run_command([sys.executable, "-m", "trainer.export", "--workdir", copy, *args])

    result = export("--out", str(tmp_path / "params"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert (
        result.stderr.strip().splitlines()[-1].startswith("error: checkpoint 8 in")
        and "is unreadable" in result.stderr
        and "--step" in result.stderr
    )
    os.mkdir(tmp_path / "export_copy" / "checkpoints" / "10")  # an empty step directory
    result = export("--out", str(tmp_path / "params"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: checkpoint 10 in {tmp_path / 'export_copy' / 'checkpoints'} is unreadable (its "
        "state has no metadata (an empty or cut step directory?)); export another with --step "
        "(there are [4, 6, 8])"
    ]
    result = export("--out", str(tmp_path / "export_copy"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "already exists" in result.stderr.strip().splitlines()[-1]


def _process_state(pid: int) -> str:
    """The one-letter state of ``pid`` from /proc ("T": stopped), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return ""


def _tree(path) -> dict[str, int]:
    """Every file under ``path`` with its size."""
    return {
        os.path.relpath(os.path.join(root, name), path): os.path.getsize(os.path.join(root, name))
        for root, _, names in os.walk(path)
        for name in names
    }


def _readers(shared, workdir, out) -> dict[str, tuple[list[str], str | None]]:
    """Every command that reads a run: ``name: (command, stdin)``."""
    python = [sys.executable, "-m"]
    return {
        "evaluate": (
            [*python, "trainer.evaluate", f"--workdir={workdir}", "--cpu_devices=8"],
            None,
        ),
        "translate": (
            [*python, "trainer.translate", f"--workdir={workdir}", "--cpu_devices=8"],
            "every ship holds your dark chair\n",
        ),
        "export": (
            [*python, "trainer.export", f"--workdir={workdir}", f"--out={out}/params"],
            None,
        ),
        "init_from": (
            command(
                shared, f"{out}/finetune", init_from=workdir, num_train_steps=2, steps_per_loop=2
            ),
            None,
        ),
        "plot": ([*python, "trainer.plot", workdir, f"--out={out}/runs.png"], None),
    }


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
@pytest.mark.soak  # a save held in flight for a minute
def test_readers_leave_a_save_in_flight_alone(shared, reference, tmp_path):
    """A run frozen (SIGSTOP) inside its second save, with the save's temporary directory
    in place: every command that reads a run works on the newest complete checkpoint and
    leaves that directory as it is; the run, continued, saves it, finishes with every
    checkpoint and the reference's losses, while another reader reads beside it."""
    workdir = str(tmp_path / "run")
    proc = start_command(command(shared, workdir), WUS_FAULT="save:stop:2")
    try:
        deadline = time.time() + 240
        while _process_state(proc.pid) != "T" and time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            time.sleep(0.05)
        assert _process_state(proc.pid) == "T", "the run never reached its second save"
        assert steps(workdir) == ["2", "4.orbax-checkpoint-tmp"]
        temporary = _tree(os.path.join(workdir, "checkpoints", "4.orbax-checkpoint-tmp"))

        readers = _readers(shared, workdir, str(tmp_path))
        with ThreadPoolExecutor(3) as pool:
            done = dict(
                zip(
                    readers,
                    pool.map(lambda c: run_command(c[0], stdin=c[1]), readers.values()),
                    strict=True,
                )
            )
        for name, result in done.items():
            assert result.returncode == 0, (name, clean(result)[-3000:])
            clean(result)
        assert "step 2 |" in done["evaluate"].stdout  # the newest complete checkpoint
        assert "checkpoint 2 of" in done["init_from"].stdout
        # The save in flight is exactly as the frozen run left it.
        assert steps(workdir) == ["2", "4.orbax-checkpoint-tmp"]
        assert _tree(os.path.join(workdir, "checkpoints", "4.orbax-checkpoint-tmp")) == temporary

        os.kill(proc.pid, signal.SIGCONT)
        # A reader beside a run that trains and saves as usual.
        evaluate, stdin = readers["evaluate"]
        beside = run_command(evaluate, stdin=stdin)
        out = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert beside.returncode == 0, clean(beside)[-3000:]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "error:" not in out, out[-3000:]
    assert steps(workdir) == ["4", "6", "8"]  # keep_checkpoints=3
    assert losses(workdir) == reference
