"""Runs many short ``python -m MODULE ARGS...`` commands as forks of one process that
has imported the libraries they import, for the tests that run a command per user
mistake (tests/command/test_cli_errors.py).

A mistake's command spends nearly all its 3-3.5 s importing JAX, Flax, Orbax and the
trainer; the check that refuses the input takes the rest. Here the imports are paid
once: each command is a fork of a process that imported them (and initialised no JAX
backend, so each command still sets up its own devices), run as ``python -m`` runs it
(``runpy``, as ``__main__``, with its ``sys.argv``), its stdout and stderr captured
apart. What differs from a fresh interpreter: nothing that the imports print reaches
the command's output, and the imports' module-level state is shared (each command
has its own copy after the fork). One of the default suite's mistakes runs as a
fresh process, which keeps both covered.

As a script, ``python tests/command/forked.py OUT.json`` (started with the commands'
environment, from the checkout): reads ``[[module, arg, ...], ...]`` as JSON on stdin
and writes ``[{"returncode": int, "stdout": str, "stderr": str}, ...]`` to OUT.json.
"""

import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

# What the commands import before they check their input (trainer/__main__.py and
# the other entry points; the training module brings JAX, Flax, Orbax and the
# experiment with it): library modules only, no entry point (each defines its absl
# flags when it runs, and runs once per fork).
PRELOAD = ("trainer.command.process", "trainer.training.train")
AT_ONCE = 3  # on 2 cores, a command waiting on its files overlaps another's compute
TIMEOUT_S = 300


def _child(module: str, args: list[str], out: str, err: str) -> None:
    """Runs ``python -m module *args`` in this (forked) process, its stdout and stderr
    written to the files ``out`` and ``err``, and exits with its code."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the JSON of the commands was read
    for fd, path in ((1, out), (2, err)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.argv = [module, *args]  # run_module puts the module's file first, as -m does
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:  # sys.exit("message"), as the interpreter does it
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught one)
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def run_all(commands: list[list[str]], tmp: str) -> list[dict]:
    """Each ``[module, *args]`` of ``commands`` run in a fork, :data:`AT_ONCE` at a time,
    its output in files under ``tmp``."""
    for module in PRELOAD:
        __import__(module)
    # A fork copies only the forking thread: a lock another thread held stays held.
    assert threading.active_count() == 1, threading.enumerate()
    sys.stdout.flush()
    sys.stderr.flush()
    results: list[dict | None] = [None] * len(commands)
    running: dict[int, tuple[int, float]] = {}
    pending = list(enumerate(commands))

    def outputs(i: int) -> tuple[str, str]:
        return os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")

    while pending or running:
        while pending and len(running) < AT_ONCE:
            i, (module, *args) = pending.pop(0)
            pid = os.fork()
            if pid == 0:
                _child(module, args, *outputs(i))
            running[pid] = (i, time.monotonic())
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            for other, (_, started) in running.items():
                if time.monotonic() - started > TIMEOUT_S:
                    os.kill(other, signal.SIGKILL)
            time.sleep(0.02)
            continue
        i, _ = running.pop(pid)
        texts = []
        for path in outputs(i):
            with open(path, errors="replace") as f:
                texts.append(f.read())
        results[i] = {
            "returncode": os.waitstatus_to_exitcode(status),
            "stdout": texts[0],
            "stderr": texts[1],
        }
    return results


def run_commands(commands: list[list[str]], cwd: str, env: dict[str, str]) -> list:
    """``python -m`` commands (``[sys.executable, "-m", module, *args]``) as
    ``subprocess.CompletedProcess``es, run by this file as a script in ``cwd`` with
    ``env``."""
    if not commands:
        return []
    modules = []
    for command in commands:
        assert command[:2] == [sys.executable, "-m"], command
        modules.append(command[2:])
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.json")
        run = subprocess.run(
            [sys.executable, os.path.abspath(__file__), out],
            cwd=cwd,
            env=env,
            input=json.dumps(modules),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S * len(commands),
        )
        assert run.returncode == 0, run.stderr[-3000:]
        with open(out) as f:
            results = json.load(f)
    return [
        subprocess.CompletedProcess(command, r["returncode"], r["stdout"], r["stderr"])
        for command, r in zip(commands, results, strict=True)
    ]


if __name__ == "__main__":
    # The script's own directory is not the commands' sys.path[0]: the checkout is.
    sys.path[0] = os.getcwd()
    with tempfile.TemporaryDirectory() as outputs:
        results = run_all(json.load(sys.stdin), outputs)
    with open(sys.argv[1], "w") as f:
        json.dump(results, f)
