"""Several processes on this machine as one JAX job (gloo collectives)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from conftest import run_command, start_command, tiny_command, tiny_flags

# Several processes per test: minutes. The stops (signals, a killed or frozen peer) are
# soaks: ``scripts/soak.py --tests`` repeats them.

# The input order is global (trainer/input/order.py): process p of n reads block p of
# every global batch, so the global batches - hence the losses - do not depend on n.
RUN = {
    "num_train_steps": 24,
    "steps_per_loop": 12,
    "log_every_steps": 12,
    "eval_every_steps": 0,
    "checkpoint_every_steps": 12,
    "data.num_eval_examples": 16,
    "max_decode_length": 4,
}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """tiny_translation with its vocabulary and token lengths, prepared once."""
    from configs import transformer_1024
    from trainer import tasks

    path = str(tmp_path_factory.mktemp("tfds"))
    config = transformer_1024.get_config("tiny")
    config.data.data_dir = path
    tasks.open_data(config)
    return path


def launch_flags(processes, flags, timeout=600):
    """The trainer with ``flags`` as ``launch.local`` runs it: ``processes`` processes
    sharing 8 CPU devices."""
    cmd = [sys.executable, "-m", "launch.local", f"--num_processes={processes}", "--cpu_devices=8"]
    return run_command([*cmd, "--", *flags], timeout=timeout)


def launch(workdir, processes, data_dir, timeout=600, **overrides):
    return launch_flags(processes, tiny_flags(workdir, data_dir, **{**RUN, **overrides}), timeout)


def single(workdir, data_dir, timeout=600):
    return run_command(tiny_command(workdir, data_dir, **RUN), timeout=timeout)


@pytest.fixture(scope="module")
def one_process_run(tmp_path_factory, data_dir):
    workdir = tmp_path_factory.mktemp("one")
    result = single(workdir, data_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    return workdir


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


def position(workdir, step):
    with open(os.path.join(workdir, "checkpoints", str(step), "data", "position.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, data_dir):
    # Two processes of 4 devices each (more, on 2 cores, only make the suite slower).
    workdir = tmp_path_factory.mktemp("two")
    result = launch(workdir, 2, data_dir)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result.stdout


def assert_same_falling_losses(one, two, steps):
    """Two runs' logged losses: at the same ``steps``, equal to 1e-4, and falling."""
    assert sorted(one) == sorted(two) == steps
    for step in steps:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    assert one[steps[-1]] < one[steps[0]]


@pytest.mark.slow
def test_process_counts_give_the_same_losses(two_process_run, one_process_run):
    workdir, out = two_process_run
    assert "[p0] step      24/24" in out and "[p1] step" not in out  # only process 0 reports
    assert_same_falling_losses(losses(one_process_run), losses(workdir), [12, 24])
    assert position(workdir, 24) == position(one_process_run, 24) == {"global_batch": 24}


@pytest.mark.slow
def test_a_language_model_trains_the_same_on_two_processes_as_on_one(tmp_path):
    # The decoder on its own text (tokenized per process, rows in one global order),
    # with per-layer gathering under tensor parallelism (data 4 x model 2: each layer's
    # gather on each model shard by itself): 2 processes x 4 devices against 1 x 8.
    flags = [
        "--config=configs/llama.py:text",
        f"--config.data.data_dir={tmp_path / 'data'}",
        "--config.num_train_steps=20",
        "--config.steps_per_loop=10",
        "--config.log_every_steps=10",
        "--config.eval_every_steps=20",
        "--config.eval_at_start=false",
        "--config.checkpoint_every_steps=20",
        "--config.data.num_eval_rows=16",
        "--config.optimizer.update_sharding=per_layer",
        "--config.mesh.axes.model=2",
    ]
    command = [sys.executable, "-m", "trainer", "--cpu_devices=8"]
    one = run_command([*command, f"--workdir={tmp_path / 'one'}", *flags], timeout=600)
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = launch_flags(2, [f"--workdir={tmp_path / 'two'}", *flags])
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "mesh {'replica': 1, 'data': 4, 'model': 2}" in two.stdout + two.stderr
    assert_same_falling_losses(losses(tmp_path / "one"), losses(tmp_path / "two"), [10, 20])
    evals = {}
    for n, name in ((1, "one"), (2, "two")):
        with open(tmp_path / name / "summary.json") as f:
            evals[n] = json.load(f)["final_eval"]
    # The held-out documents and the 16 eval rows are the same on both (the eval of
    # the 2-process checkpoint by one process gives its figure exactly); the weights
    # are not bit-equal: bf16 activations, and a cross-process reduction sums in
    # another order, which 20 steps turn into 1e-4 on the final window's loss and
    # about 1e-3 on the eval loss of the final weights.
    assert evals[2]["eval/loss"] == pytest.approx(evals[1]["eval/loss"], rel=2e-3)
    assert evals[2]["eval/accuracy"] == pytest.approx(evals[1]["eval/accuracy"], abs=2e-3)


@pytest.mark.slow
def test_two_slices_train_as_one_and_checkpoints_cross_between_them(
    one_process_run, data_dir, tmp_path
):
    # Each of the 2 processes stands in for a slice (mesh.dcn_axes.data=2, as on TPU
    # multislice): groups of 4 inside each, the shards' all-reduce across them.
    result = launch(tmp_path / "slices", 2, data_dir, **{"mesh.dcn_axes.data": 2})
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert (
        "[p0] shard groups: group = 4 cpu devices in device order (no torus); 1 group; "
        "in each of 2 processes standing in for slices (DCN between them)" in out
    )
    assert "mesh {'replica': 2, 'data': 4, 'model': 1}" in out
    one, two = losses(one_process_run), losses(tmp_path / "slices")
    assert sorted(two) == [12, 24]
    for step in two:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    # Its step-12 checkpoint resumes on one slice (one process, 8 devices), and the
    # one-slice run's step-12 checkpoint on two: both end where the others did.
    for source, resume in (
        (tmp_path / "slices", lambda w: single(w, data_dir)),
        (one_process_run, lambda w: launch(w, 2, data_dir, **{"mesh.dcn_axes.data": 2})),
    ):
        workdir = tmp_path / f"from_{source.name}"
        shutil.copytree(source, workdir)
        shutil.rmtree(workdir / "checkpoints" / "24")
        result = resume(workdir)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        assert "resumed from the checkpoint of step 12" in result.stdout
        assert losses(workdir)[24] == pytest.approx(losses(source)[24], rel=1e-4)


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_one_process(two_process_run, data_dir, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(two_process_run[0], workdir)
    shutil.rmtree(workdir / "checkpoints" / "24")  # Resume from step 12 of the 2-process run.
    assert position(workdir, 12) == {"global_batch": 12}
    result = single(workdir, data_dir)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "resumed from the checkpoint of step 12" in out
    # Steps 13-24 on one process took exactly the batches the 2-process run took.
    assert losses(workdir)[24] == pytest.approx(losses(two_process_run[0])[24], rel=1e-4)


@pytest.mark.soak
def test_killed_process_stops_the_job(tmp_path):
    # Synthetic tokens: data_dir is not read.
    overrides = {**RUN, "num_train_steps": 100000, "data.name": "synthetic"}
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        "--num_processes=2",
        "--cpu_devices=8",
        "--grace=10",
        "--",
        *tiny_flags(tmp_path, tmp_path / "tfds", **overrides),
        "--heartbeat_timeout=10",
    ]
    launcher = start_command(cmd)
    deadline = time.time() + 300
    while time.time() < deadline:
        line = launcher.stdout.readline()
        if "step      12/" in line:
            break
    # Kill process 1 the hard way; find it by its unique command line.
    pids = subprocess.run(
        ["pgrep", "-f", f"workdir={tmp_path}.*process_id=1"], capture_output=True, text=True
    ).stdout.split()
    assert pids, "process 1 not found"
    os.kill(int(pids[0]), signal.SIGKILL)
    start = time.time()
    out = launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0
    assert time.time() - start < 60
    assert "process 1 exited with code -9; stopping the others" in out
    leftover = subprocess.run(
        ["pgrep", "-f", f"workdir={tmp_path}"], capture_output=True, text=True
    )
    assert not leftover.stdout.strip(), "a trainer process outlived the launcher"


# Preemption: 10 loops of 4 steps, a checkpoint only at the end or when stopped, so the
# step saved is the step the processes agreed to stop at. A stop asked at the line of
# step 12 must land before the last boundary: on a loaded machine the signal can take
# a loop or two to arrive and the stop another loop to be agreed (6 loops were tight).
PREEMPT_STEPS = 40
PREEMPT = {
    **RUN,
    "num_train_steps": PREEMPT_STEPS,
    "steps_per_loop": 4,
    "log_every_steps": 4,
    "checkpoint_every_steps": 0,
}


def preempt_flags(workdir, data_dir):
    return tiny_flags(workdir, data_dir, **PREEMPT)


def launcher_command(workdir, data_dir):
    return [
        sys.executable,
        "-m",
        "launch.local",
        "--num_processes=2",
        "--cpu_devices=8",
        "--",
        *preempt_flags(workdir, data_dir),
    ]


def wait_for(proc, text, timeout=300):
    """Reads ``proc``'s merged output until a line contains ``text``; returns what it read."""
    seen, deadline = [], time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    proc.kill()
    raise AssertionError(f"{text!r} never came:\n" + "".join(seen)[-3000:])


def saved_steps(workdir):
    names = os.listdir(os.path.join(workdir, "checkpoints"))
    return sorted(int(n) for n in names if n.isdigit())


def summary(workdir) -> dict:
    with open(os.path.join(workdir, "summary.json")) as f:
        return json.load(f)


def stopped_by_sigterm(proc, target, workdir, after: int, by: str = "SIGTERM"):
    """Sends SIGTERM to ``target()`` (a pid) once ``proc`` has logged step ``after``;
    returns the whole output and the step the job saved, after checking that it
    stopped before the end, cleanly, and that ``summary.json`` says it was stopped
    ``by`` that (the signal, and to which process when not to process 0)."""
    head = wait_for(proc, f"step {after:7d}/{PREEMPT_STEPS}")
    os.kill(target(), signal.SIGTERM)
    out = head + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    # No periodic checkpoints: any saved step is the stop's own. It is ``after`` when the
    # signal lands before the next loop starts, a later loop boundary otherwise.
    saved = max(saved_steps(workdir))
    assert after <= saved < PREEMPT_STEPS, out[-3000:]
    how = "preempted" + (f" ({by})" if " to " in by else "")
    assert f"{how}: saved step {saved}; newest complete checkpoint: step {saved}" in out
    done = summary(workdir)
    assert (done["status"], done["last_step"]) == (f"stopped ({by})", saved), done
    return out, saved


@pytest.fixture(scope="module")
def preempt_reference(tmp_path_factory, data_dir):
    """The 2-process run's losses, uninterrupted."""
    workdir = tmp_path_factory.mktemp("preempt_reference")
    result = run_command(launcher_command(workdir, data_dir), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # Both processes left cleanly: the job's share of the lock went with them, and the
    # launcher's console has none of Gloo's connection lines.
    assert not (workdir / "run.lock.peers").exists() and not (workdir / "run.lock").exists()
    assert "[Gloo]" not in result.stdout + result.stderr
    return losses(workdir)


@pytest.mark.soak
def test_sigterm_to_the_launcher_or_one_process_saves_and_resumes_exactly(
    preempt_reference, data_dir, tmp_path
):
    # SIGTERM to launch.local (as SLURM or Kubernetes sends it): every process stops
    # at the same loop boundary, saves that step and exits 0.
    launcher = start_command(launcher_command(tmp_path, data_dir))
    out, first = stopped_by_sigterm(launcher, lambda: launcher.pid, tmp_path, after=4)
    assert "[p0] SIGTERM: saving at the end of the current loop" in out
    assert "[p1] SIGTERM: saving at the end of the current loop" in out

    # SIGTERM to process 1 alone: process 0 learns it at the next boundary, and both stop.
    def process_1():
        pids = subprocess.run(
            ["pgrep", "-f", f"workdir={tmp_path}.*process_id=1"], capture_output=True, text=True
        ).stdout.split()
        assert len(pids) == 1, pids
        return int(pids[0])

    launcher = start_command(launcher_command(tmp_path, data_dir))
    out, second = stopped_by_sigterm(
        launcher, process_1, tmp_path, after=first + 4, by="SIGTERM to process 1"
    )
    assert f"resumed from the checkpoint of step {first}" in out
    assert "[p1] SIGTERM: saving at the end of the current loop" in out
    assert "[p0] SIGTERM" not in out
    # The rest of the run: every logged loss equals the uninterrupted run's.
    result = run_command(launcher_command(tmp_path, data_dir), timeout=600)
    assert result.returncode == 0, result.stdout[-3000:]
    assert losses(tmp_path) == preempt_reference


@pytest.mark.soak
def test_sigterm_to_a_lone_process_with_a_coordinator_saves_and_resumes_exactly(data_dir, tmp_path):
    # jax.distributed with one process: the same stop path as a pod's. (Its CPU
    # collectives differ from a plain process's in the last digits: so does the reference.)
    from launch.local import free_port

    def command(workdir):
        return [
            sys.executable,
            "-m",
            "trainer",
            "--cpu_devices=8",
            *preempt_flags(workdir, data_dir),
            f"--coordinator_address=127.0.0.1:{free_port()}",
            "--num_processes=1",
            "--process_id=0",
        ]

    result = run_command(command(tmp_path / "reference"))
    assert result.returncode == 0, result.stderr[-3000:]
    proc = start_command(command(tmp_path / "run"))
    out, _ = stopped_by_sigterm(proc, lambda: proc.pid, tmp_path / "run", after=4)
    assert "SIGTERM: saving at the end of the current loop" in out
    result = run_command(command(tmp_path / "run"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(tmp_path / "run") == losses(tmp_path / "reference")


def process_pid(workdir, index: int) -> int:
    pids = subprocess.run(
        ["pgrep", "-f", f"workdir={workdir}.*process_id={index}"], capture_output=True, text=True
    ).stdout.split()
    assert len(pids) == 1, pids
    return int(pids[0])


@pytest.mark.soak
def test_a_frozen_peer_ends_the_job_in_one_line(data_dir, tmp_path):
    # Process 1 freezes (SIGSTOP): process 0 waits inside a collective, where JAX's
    # coordination service would abort it a minute or two later with a C++ log. The
    # job's own watch names the lost process within --heartbeat_timeout instead.
    flags = tiny_flags(tmp_path, data_dir, **{**PREEMPT, "num_train_steps": 100000})
    cmd = [sys.executable, "-m", "launch.local", "--num_processes=2", "--cpu_devices=8"]
    launcher = start_command([*cmd, "--", *flags, "--heartbeat_timeout=10"])
    head = wait_for(launcher, "step       8/")
    frozen = process_pid(tmp_path, 1)
    os.kill(frozen, signal.SIGSTOP)
    start = time.time()
    try:
        out = head + wait_for(launcher, "error:", timeout=120)
        took = time.time() - start
    finally:
        os.kill(frozen, signal.SIGCONT)
    out += launcher.communicate(timeout=120)[0]
    assert launcher.returncode != 0
    errors = [line for line in out.splitlines() if "error:" in line]
    assert errors[0].startswith("[p0] error: process 1 of 2 stopped answering: nothing from it")
    assert "while process 0 was training, past step" in errors[0]
    # Up to the job's end nothing but that line. Process 1, continued once the line is
    # out, finds its coordinator gone: what it prints then is after the fact, and may
    # come before process 0 has finished leaving (a loaded machine).
    before, _, after = out.split("[launch] process 0 exited")[0].partition(errors[0])
    ended = before + "\n".join(x for x in after.splitlines() if not x.startswith("[p1]"))
    assert "Traceback" not in ended and "Terminating process" not in ended, ended[-3000:]
    # The watch counts from when it last saw process 1's counter move, which a beat
    # (every 10/6 s) may have read up to a beat before the SIGSTOP, plus one beat of
    # process 1's own: the line comes 10 s after that moment, not after the signal.
    assert 10 - 2 * 10 / 6 <= took < 60, took
    done = summary(tmp_path)
    assert done["status"] == "failed" and "process 1 of 2 stopped answering" in done["error"]
    assert not (tmp_path / "run.lock").exists()


@pytest.mark.soak
def test_ctrl_c_twice_stops_at_once_and_says_so_in_the_summary(data_dir, tmp_path):
    flags = tiny_flags(tmp_path, data_dir, **{**PREEMPT, "num_train_steps": 100000})
    cmd = [sys.executable, "-m", "launch.local", "--num_processes=2", "--cpu_devices=8"]
    launcher = start_command([*cmd, "--", *flags])
    head = wait_for(launcher, "step       8/")
    for _ in range(2):
        os.kill(launcher.pid, signal.SIGINT)
        time.sleep(0.3)
    out = head + launcher.communicate(timeout=120)[0]
    assert launcher.returncode == 130, out[-3000:]
    assert "stopped now (Ctrl-C twice)" in out and "Traceback" not in out, out[-3000:]
    done = summary(tmp_path)
    assert done["status"] == "stopped (Ctrl-C twice)", done
    assert not (tmp_path / "run.lock").exists() and not (tmp_path / "run.lock.peers").exists()
