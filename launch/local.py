"""Run P trainer processes on this machine as one JAX job.

    python -m launch.local --num_processes 2 --cpu_devices 8 -- \\
        --config configs/transformer_1024.py:tiny --workdir /tmp/demo2

Process i gets ``--coordinator_address 127.0.0.1:<free port> --num_processes P
--process_id i --cpu_devices N/P``, so the P processes form one global mesh of
N CPU devices (collectives over gloo). Their output is prefixed with ``[pI]``.
If one process fails, the others are stopped and the launcher exits with the
failed process's code; SIGTERM/SIGINT are passed on to every process.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port() -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(prefix: str, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"{prefix} {line}")
        out.flush()


def launch(
    trainer_args: list[str],
    *,
    num_processes: int,
    cpu_devices: int,
    grace_s: float = 30.0,
    module: str = "trainer",
) -> int:
    """Starts the processes and supervises them; returns the exit code."""
    if cpu_devices % num_processes:
        print(f"error: --cpu_devices={cpu_devices} does not divide by "
              f"--num_processes={num_processes}", file=sys.stderr)  # fmt: skip
        return 2
    address = f"127.0.0.1:{free_port()}"
    procs = []
    for i in range(num_processes):
        cmd = [
            sys.executable, "-m", module, *trainer_args,
            f"--coordinator_address={address}", f"--num_processes={num_processes}",
            f"--process_id={i}", f"--cpu_devices={cpu_devices // num_processes}",
        ]  # fmt: skip
        env = dict(os.environ)
        env.pop("XLA_FLAGS", None)  # the device count comes from --cpu_devices
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        threading.Thread(
            target=_pump, args=(f"[p{i}]", proc.stdout, sys.stdout), daemon=True
        ).start()
        procs.append(proc)

    def forward(signum, frame):
        del frame
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    failed = None
    while failed is None and any(p.poll() is None for p in procs):
        for i, p in enumerate(procs):
            if p.poll() not in (None, 0):
                failed = (i, p.returncode)
                break
        time.sleep(0.2)
    if failed is None:
        failed = next(((i, p.returncode) for i, p in enumerate(procs) if p.returncode), None)
    if failed is None:
        return 0
    index, code = failed
    print(f"[launch] process {index} exited with code {code}; stopping the others",
          file=sys.stderr, flush=True)  # fmt: skip
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--cpu_devices", type=int, default=8, help="devices in all")
    parser.add_argument("--grace", type=float, default=30.0, help="seconds before SIGKILL")
    parser.add_argument("trainer_args", nargs=argparse.REMAINDER, help="after --")
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
