"""Runs ``python -m MODULE ARGS...`` commands as forks of one process that has imported
the libraries they import: the same commands, without 3-3.5 s of imports apiece.

A command that stops at a user's mistake, or exports a checkpoint, or trains a few
steps of a tiny model, spends 3-3.5 s (of 4-15) importing JAX, Flax, Orbax and the
trainer. :class:`Server` starts one process (this file as a script) that imports them
once and initialises no JAX backend, so that each command still sets up its own
devices; each command is then a fork of it, run as ``python -m`` runs it (``runpy``,
as ``__main__``, with its ``sys.argv``), stdin from ``/dev/null``, stdout and stderr
in files of its own, ending as the interpreter ends (its atexit functions and
non-daemon threads run). What differs from a fresh interpreter: nothing that the
imports print reaches the command's output, and what those imports set up at module
level is shared (each command has its own copy after the fork). The suite keeps
fresh processes where either matters: commands with an input, with variables of
their own in the environment, or not ``python -m``, and one of the CLI mistakes
(tests/command/test_cli_errors.py).

The protocol: the script reads one JSON request a line on stdin, ``{"id": N, "argv":
[module, *args], "timeout": S}``, and forks a runner for it, which forks the command,
waits for it (SIGKILL after ``S`` seconds) and writes ``N.json`` (``{"returncode",
"timed_out"}``) next to ``N.out`` and ``N.err`` in the directory named on its command
line. End of input ends the server; commands still running finish on their own.
"""

import json
import os
import runpy
import shutil
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
GRACE_S = 60  # past a command's timeout, how long a client waits for its runner's word


def _serve(directory: str) -> tuple[dict, str] | None:
    """The server's loop; returns only in a forked command, with its request and the
    directory (the caller runs it at the top of the stack: see :func:`_command`)."""
    for module in PRELOAD:
        __import__(module)
    # A fork copies only the forking thread: a lock another thread held stays held.
    assert threading.active_count() == 1, threading.enumerate()
    # Runners are nobody's to wait for: the kernel reaps them.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    while line := sys.stdin.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the runner waits for its command
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's
            if (pid := os.fork()) == 0:
                return request, directory
            _runner(pid, request, directory)
    return None


def _runner(pid: int, request: dict, directory: str) -> None:
    """Waits for the command ``pid`` (killing it at its timeout), writes its result
    file and exits."""
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    while (status := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline and not timed_out:
            os.kill(pid, signal.SIGKILL)
            timed_out = True
        time.sleep(0.02)
    result = {"returncode": os.waitstatus_to_exitcode(status[1]), "timed_out": timed_out}
    path = os.path.join(directory, f"{request['id']}.json")
    with open(path + ".partial", "w") as f:
        json.dump(result, f)
    os.rename(path + ".partial", path)  # the client sees the whole file or none
    os._exit(0)


def _command(request: dict, directory: str) -> int:
    """Runs the request's ``python -m`` command in this (forked) process, its stdout and
    stderr to its files; returns its exit code."""
    for fd, suffix in ((1, "out"), (2, "err")):
        path = os.path.join(directory, f"{request['id']}.{suffix}")
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    sys.stdin = open(os.devnull)  # noqa: SIM115  (the server's may hold requests read ahead)
    module, *args = request["argv"]
    sys.argv = [module, *args]  # run_module puts the module's file first, as -m does
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)  # sys.exit("message"), as the interpreter does it
        return 1
    except BaseException:  # noqa: BLE001  (what the interpreter does with an uncaught one)
        traceback.print_exc()
        return 1
    return 0


class Server:
    """One server (see the module's docstring) started in ``cwd`` with ``env``; its
    :meth:`run` may be called from several threads at once."""

    def __init__(self, cwd: str, env: dict[str, str]):
        self.env = dict(env)
        self._directory = tempfile.mkdtemp(prefix="forked-")
        self._log = open(os.path.join(self._directory, "server.log"), "w+")  # noqa: SIM115
        self._process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), self._directory],
            cwd=cwd,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._lock = threading.Lock()
        self._next = 0

    def run(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """``command`` (``[sys.executable, "-m", module, *args]``) as ``subprocess.run``
        with ``capture_output=True, text=True`` gives it (``TimeoutExpired`` at its
        timeout, after the command is killed)."""
        assert command[:2] == [sys.executable, "-m"], command
        with self._lock:
            i = self._next
            self._next += 1
            request = {"id": i, "argv": command[2:], "timeout": timeout}
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
        path = os.path.join(self._directory, str(i))
        give_up = time.monotonic() + timeout + GRACE_S
        while not os.path.exists(path + ".json"):
            if self._process.poll() is not None or time.monotonic() > give_up:
                self._log.seek(0)
                raise RuntimeError(f"the fork server stopped answering: {self._log.read()[-3000:]}")
            time.sleep(0.02)
        texts = []
        for suffix in ("json", "out", "err"):
            with open(f"{path}.{suffix}", errors="replace") as f:
                texts.append(f.read())
            os.remove(f"{path}.{suffix}")
        result = json.loads(texts[0])
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(command, timeout, texts[1], texts[2])
        return subprocess.CompletedProcess(command, result["returncode"], texts[1], texts[2])

    def close(self) -> None:
        """Ends the server (commands still running finish on their own)."""
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._log.close()
        shutil.rmtree(self._directory, ignore_errors=True)


if __name__ == "__main__":
    # The script's own directory is not the commands' sys.path[0]: the checkout is.
    sys.path[0] = os.getcwd()
    forked = _serve(sys.argv[1])
    if forked is not None:
        # Here the stack holds nothing of the server's: the command ends as a fresh
        # interpreter would, through sys.exit (atexit functions, threads joined).
        sys.exit(_command(*forked))
