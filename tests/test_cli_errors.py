"""A user's mistakes end in one ``error:`` line and a non-zero exit, with no
traceback, across ``trainer``, ``trainer.bench`` and ``launch.local``; a second
run on a busy work directory is refused naming the holder; the launcher's
processes die with it.

The commands run as a user types them, as subprocesses, several at a time (each
stops before or right after building the model, so they are short).
"""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import REPO, command_env, run_command, tiny_command, tiny_flags


def _cases(tmp: str) -> dict[str, tuple[list[str], str]]:
    """``name: (command, text the error line contains)``."""
    afile = os.path.join(tmp, "afile")
    data = os.path.join(tmp, "tfds")

    def python(*args: str) -> list[str]:
        return [sys.executable, "-m", *args]

    def trainer(name: str, **overrides) -> list[str]:
        return tiny_command(os.path.join(tmp, name), data, **overrides)

    return {
        "no config file": (
            python("trainer", "--config", "configs/nope.py", "--workdir", os.path.join(tmp, "w")),
            "--config configs/nope.py: no such file 'configs/nope.py'",
        ),
        "typo in a key": (
            trainer("typo", num_train_step=8),
            "unknown config key 'num_train_step' (from --config.num_train_step=...); "
            "did you mean 'num_train_steps'?",
        ),
        "empty workdir": (tiny_command("", data), "--workdir is empty"),
        "workdir is a file": (
            tiny_command(afile, data),
            f"--workdir {afile} is a file, not a directory",
        ),
        "negative cpu_devices": (
            python(
                "trainer",
                "--config",
                "configs/transformer_1024.py:tiny",
                "--cpu_devices",
                "-1",
                "--workdir",
                os.path.join(tmp, "cpu"),
            ),
            "--cpu_devices must be >= 0",
        ),
        "keep no checkpoint": (
            trainer("keep", keep_checkpoints=0),
            "keep_checkpoints must be >= 1",
        ),
        "more devices than exist": (
            trainer("mesh", **{"mesh.num_devices": 16}),
            "mesh.num_devices=16 but there are 8 devices",
        ),
        "heads do not divide qkv_dim": (
            trainer("heads", **{"model.num_heads": 5}),
            "model.qkv_dim=64 must split evenly over model.num_heads=5",
        ),
        "model dtype": (
            trainer("dtype", **{"model.dtype": "bfloat61"}),
            "model.dtype='bfloat61' is not a floating-point dtype",
        ),
        "gather dtype": (
            trainer("gdtype", **{"optimizer.gather_dtype": "int3"}),
            "optimizer.gather_dtype='int3' is not a floating-point dtype",
        ),
        "sequences longer than the model": (
            trainer("maxlen", **{"data.max_length": 128}),
            "data.max_length=128 is longer than the model's position table, model.max_len=64",
        ),
        "data_dir is a file": (
            tiny_command(os.path.join(tmp, "dd"), afile),
            f"data.data_dir={afile} is a file, not a directory",
        ),
        "launcher without processes": (
            python("launch.local", "--num_processes", "0", "--", *tiny_flags(tmp, data)),
            "--num_processes must be >= 1, got 0",
        ),
        "launcher with negative processes": (
            python("launch.local", "--num_processes", "-2", "--", *tiny_flags(tmp, data)),
            "--num_processes must be >= 1, got -2",
        ),
        "bench loop length": (
            python(
                "trainer.bench",
                "--config",
                "configs/transformer_1024.py:tiny",
                "--steps_per_loop",
                "abc",
                "--cpu_devices",
                "8",
            ),
            "--steps_per_loop: expected loop lengths",
        ),
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's result, run 3 at a time (most of their time is importing JAX)."""
    tmp = str(tmp_path_factory.mktemp("mistakes"))
    open(os.path.join(tmp, "afile"), "w").close()
    cases = _cases(tmp)
    with ThreadPoolExecutor(3) as pool:
        done = dict(zip(cases, pool.map(run_command, [c for c, _ in cases.values()]), strict=True))
    return {name: (done[name], cases[name][1]) for name in cases}


@pytest.mark.parametrize("name", list(_cases("/tmp")))
def test_mistake_is_one_error_line(results, name):
    result, message = results[name]
    assert result.returncode not in (0, None), result.stdout[-2000:] + result.stderr[-2000:]
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert message in errors[0], errors[0]
    assert result.stderr.strip().splitlines()[-1] == errors[0]


def test_busy_workdir_is_refused_naming_the_holder(tmp_path):
    import fcntl

    # A live run's lock: held (flock) by this process, with the holder's description.
    lock = os.open(tmp_path / "run.lock", os.O_RDWR | os.O_CREAT)
    holder = {
        "id": "x",
        "host": "otherhost",
        "pid": 4242,
        "started": time.time(),
        "command": "python -m trainer --config first",
    }
    os.write(lock, json.dumps(holder).encode())
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        result = run_command(tiny_command(tmp_path, tmp_path / "tfds"))
    finally:
        os.close(lock)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: {tmp_path} is in use by another run (pid 4242 on host otherhost, started "
    ), last
    assert "python -m trainer --config first" in last
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.json").exists()


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_launcher_killed_takes_its_processes_along(tmp_path):
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.local",
            "--num_processes",
            "2",
            "--cpu_devices",
            "2",
            "--",
            *tiny_flags(tmp_path, tmp_path / "tfds", num_train_steps=100000),
        ],
        cwd=REPO,
        env=command_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 60
    while len(children := _children(launcher.pid)) < 2 and time.time() < deadline:
        time.sleep(0.05)
    assert len(children) == 2, children
    time.sleep(1.0)  # past the children's start-up (their parent-death signal is set)
    launcher.send_signal(signal.SIGKILL)
    launcher.wait()
    deadline = time.time() + 60
    while any(map(_alive, children)) and time.time() < deadline:
        time.sleep(0.1)
    left = [pid for pid in children if _alive(pid)]
    for pid in left:  # do not leave them running if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the launcher"
