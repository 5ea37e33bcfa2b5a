"""Run P trainer processes on this machine as one JAX job.

    python -m launch.local --num_processes 2 --cpu_devices 8 -- \\
        --config configs/transformer_1024.py:tiny --workdir /tmp/demo2

Process i gets ``--coordinator_address 127.0.0.1:<free port> --num_processes P
--process_id i --cpu_devices N/P``, so the P processes form one global mesh of
N CPU devices (collectives over gloo). Their output is prefixed with ``[pI]``.

* If one process fails, the others are stopped and the launcher exits with the
  failed process's code.
* SIGTERM and SIGINT are passed on to every process, once each: the first asks
  them to save and stop, a second Ctrl-C stops them now (trainer/command/signals.py).
  Each process runs in its own process group, so a terminal's Ctrl-C reaches
  the launcher only, not every process (and data worker) a second time.
* The processes die with the launcher, whatever kills it. When it exits, it
  kills each process group (a trainer and its data workers). When it is killed
  (even by SIGKILL), the kernel signals each process (Linux's parent-death
  signal; ``WUS_LAUNCHER`` tells them who their launcher is): it stops
  writing to the dead launcher's pipes, saves at the next loop boundary if it
  can, and kills itself and its data workers ``--grace`` seconds later at the
  latest (trainer/command/signals.py).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

_PR_SET_PDEATHSIG = 1  # prctl(2)


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo's "[Gloo] Rank 3 is connected to 7 peer ranks. Expected number of connected peer
# ranks is : 7", once per rank and collective group, from threads that write over each
# other ("[Gloo] Rank [Gloo] Rank 1 is ..."): every piece of them is dropped.
_GLOO = re.compile(r"\[Gloo\] Rank|is connected to \d+ peer ranks|connected peer ranks is")
# With nothing printed for this long, the launcher says the job is still running.
QUIET_S = 14.0


def is_gloo_noise(line: str) -> bool:
    """Whether ``line`` is (a piece of) Gloo's connection report."""
    return bool(_GLOO.search(line))


class _Output:
    """The processes' lines on the launcher's stdout, prefixed ``[pI]``, without Gloo's
    connection lines; :meth:`heartbeat` says the job is alive when it is quiet."""

    def __init__(self, out):
        self._out = out
        self._lock = threading.Lock()
        self._start = self.last = time.monotonic()

    def pump(self, prefix: str, stream) -> None:
        for line in iter(stream.readline, ""):
            if is_gloo_noise(line):
                continue
            self.write(f"{prefix} {line}")

    def write(self, text: str) -> None:
        with self._lock:
            self._out.write(text)
            self._out.flush()
            self.last = time.monotonic()

    def heartbeat(self, procs: list[subprocess.Popen], done: threading.Event) -> None:
        """A line whenever the processes have said nothing for :data:`QUIET_S`
        (a run between its log lines, a long compile)."""
        while not done.wait(1.0):
            now = time.monotonic()
            if now - self.last >= QUIET_S:
                running = sum(p.poll() is None for p in procs)
                self.write(
                    f"[launch] {running} of {len(procs)} processes running, "
                    f"{_duration(now - self._start)} since the start, quiet for "
                    f"{_duration(now - self.last)}\n"
                )


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _die_with(parent: int, libc) -> None:
    """In the child before exec: a signal when ``parent`` dies (even by SIGKILL).

    SIGUSR1 ends a process that has not set up its handling yet; the trainer's
    handling stops the run and kills what is left after the grace period.
    """
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1)
    if os.getppid() != parent:  # the launcher died before prctl took effect
        os._exit(1)


def check_arguments(num_processes: int, cpu_devices: int, grace_s: float) -> str | None:
    """The one-line complaint about the launcher's arguments, or None."""
    if num_processes < 1:
        return f"--num_processes must be >= 1, got {num_processes}"
    if cpu_devices < 1:
        return f"--cpu_devices must be >= 1, got {cpu_devices}"
    if cpu_devices % num_processes:
        return f"--cpu_devices={cpu_devices} does not divide by --num_processes={num_processes}"
    if grace_s < 0:
        return f"--grace must be >= 0 seconds, got {grace_s}"
    return None


def launch(
    trainer_args: list[str],
    *,
    num_processes: int,
    cpu_devices: int,
    grace_s: float = 30.0,
    module: str = "trainer",
) -> int:
    """Starts the processes and supervises them; returns the exit code."""
    problem = check_arguments(num_processes, cpu_devices, grace_s)
    if problem:
        print(f"error: {problem}", file=sys.stderr, flush=True)
        return 2
    procs: list[subprocess.Popen] = []
    forwarded: list[int] = []

    def forward(signum, frame):
        del frame
        forwarded.append(signum)
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    # Before any process starts: a signal from now on reaches them all.
    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    try:
        libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
    except OSError:
        libc = None
    address = f"127.0.0.1:{free_port()}"
    launcher = os.getpid()
    for i in range(num_processes):
        cmd = [
            sys.executable,
            "-m",
            module,
            *trainer_args,
            f"--coordinator_address={address}",
            f"--num_processes={num_processes}",
            f"--process_id={i}",
            f"--cpu_devices={cpu_devices // num_processes}",
        ]
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # the device count comes from --cpu_devices
        env["WUS_LAUNCHER"] = f"{launcher}:{grace_s:g}"  # trainer/command/signals.py
        # Started before any thread of ours runs, so preexec_fn is safe here.
        procs.append(
            subprocess.Popen(
                cmd,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                process_group=0,
                preexec_fn=lambda: _die_with(launcher, libc),
            )
        )
    output, done = _Output(sys.stdout), threading.Event()
    pumps = [
        threading.Thread(target=output.pump, args=(f"[p{i}]", p.stdout), daemon=True)
        for i, p in enumerate(procs)
    ]
    for pump in pumps:
        pump.start()
    threading.Thread(target=output.heartbeat, args=(procs, done), daemon=True).start()
    try:
        return _supervise(procs, forwarded, grace_s)
    finally:
        done.set()
        for p in procs:  # whatever a process left (its data workers), and stragglers
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for pump in pumps:
            pump.join(timeout=5)


def _supervise(procs: list[subprocess.Popen], forwarded: list[int], grace_s: float) -> int:
    """Waits for the processes; stops the rest when one fails. Returns the exit code."""

    def failures() -> list[tuple[int, int]]:
        return [(i, p.returncode) for i, p in enumerate(procs) if p.poll() not in (None, 0)]

    while any(p.poll() is None for p in procs) and not (failures() and not forwarded):
        time.sleep(0.2)
    if not failures() or forwarded:
        codes = [p.wait() for p in procs]
        return next((c if c > 0 else 128 - c for c in codes if c), 0)
    # The cause: a process killed by a signal, whose peers then fail on the lost
    # connection (possibly before this loop looks), else the first that failed.
    index, code = min(failures(), key=lambda failure: (failure[1] >= 0, failure[0]))
    print(
        f"[launch] process {index} exited with code {code}; stopping the others",
        file=sys.stderr,
        flush=True,
    )
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.time(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
    return code if code > 0 else 1


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """One line, like the trainer's mistakes (argparse adds the usage)."""
        print(f"error: {message} (see --help)", file=sys.stderr, flush=True)
        sys.exit(2)


def main() -> None:
    parser = _Parser(
        prog="python -m launch.local",
        usage="python -m launch.local --num_processes P [--cpu_devices N] [--grace S] -- "
        "TRAINER_FLAGS",
        description=__doc__.split("\n")[0],
        # The example as one command, not wrapped mid-flag.
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  python -m launch.local --num_processes 2 --cpu_devices 8 -- \\\n"
        "      --config configs/transformer_1024.py:tiny --workdir /tmp/demo2",
    )
    parser.add_argument(
        "--num_processes",
        type=int,
        required=True,
        metavar="P",
        help="trainer processes to start (the job's)",
    )
    parser.add_argument(
        "--cpu_devices",
        type=int,
        default=8,
        metavar="N",
        help="CPU devices of the whole job, split evenly over the processes (default 8)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds the processes get to save and stop after a SIGTERM or Ctrl-C, or "
        "after this launcher dies, before they are killed (default 30)",
    )
    parser.add_argument(
        "trainer_args",
        nargs=argparse.REMAINDER,
        help="after --: the flags of python -m trainer for every process",
    )
    args = parser.parse_args()
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    sys.exit(
        launch(
            trainer_args,
            num_processes=args.num_processes,
            cpu_devices=args.cpu_devices,
            grace_s=args.grace,
        )
    )


if __name__ == "__main__":
    main()
