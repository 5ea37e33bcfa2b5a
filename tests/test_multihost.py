"""Several processes on this machine as one JAX job (gloo collectives)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Synthetic rows are a function of their global index and each process takes
# rows i::n, so the global batches - hence the losses - do not depend on n.
RUN = [
    "--config", "configs/transformer_1024.py:tiny", "--config.data.name=synthetic",
    "--config.num_train_steps=20", "--config.steps_per_loop=10", "--config.log_every_steps=10",
    "--config.eval_every_steps=0", "--config.checkpoint_every_steps=10",
    "--config.data.num_eval_examples=16", "--config.max_decode_length=4",
]  # fmt: skip


def _env():
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    return env


def launch(workdir, processes, *extra, timeout=600):
    cmd = [sys.executable, "-m", "launch.local", f"--num_processes={processes}",
           "--cpu_devices=8", "--", *RUN, f"--workdir={workdir}", *extra]  # fmt: skip
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def single(workdir, *extra, timeout=600):
    cmd = [sys.executable, "-m", "trainer", *RUN, f"--workdir={workdir}", "--cpu_devices=8", *extra]
    return subprocess.run(
        cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def losses(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return {row["step"]: row["loss"] for row in map(json.loads, f)}


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("two")
    result = launch(workdir, 2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return workdir, result.stdout


def test_two_processes_match_one(two_process_run, tmp_path):
    workdir, out = two_process_run
    assert "[p0] step      20/20" in out and "[p1] step" not in out  # only process 0 reports
    result = single(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    two, one = losses(workdir), losses(tmp_path)
    assert sorted(two) == sorted(one) == [10, 20]
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=1e-4), step
    assert one[20] < one[10]


@pytest.mark.parametrize("processes", [1, 4])
def test_two_process_checkpoint_resumes_with_other_process_counts(
    two_process_run, tmp_path, processes
):
    workdir = tmp_path / "run"
    shutil.copytree(two_process_run[0], workdir)
    extra = "--config.num_train_steps=30"
    result = single(workdir, extra) if processes == 1 else launch(workdir, processes, extra)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "resumed from the checkpoint of step 20" in out
    assert "different number of processes" in out
    assert max(losses(workdir)) == 30


def test_killed_process_stops_the_job(tmp_path):
    cmd = [sys.executable, "-m", "launch.local", "--num_processes=2", "--cpu_devices=8",
           "--grace=10", "--", *RUN, f"--workdir={tmp_path}", "--config.num_train_steps=100000",
           "--heartbeat_timeout=10"]  # fmt: skip
    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        line = launcher.stdout.readline()
        if "step      10/" in line:
            break
    # Kill process 1 the hard way; find it by its unique command line.
    pids = subprocess.run(["pgrep", "-f", f"workdir={tmp_path}.*process_id=1"],
                          capture_output=True, text=True).stdout.split()  # fmt: skip
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
