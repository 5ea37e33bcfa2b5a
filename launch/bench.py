"""Start-up time and throughput of 1, 2, 4 ... local processes on the same devices.

    python -m launch.bench --processes 1,2,4 --cpu_devices 8 -- \\
        --config configs/transformer_1024.py:tiny --config.data.name=synthetic

For each process count, runs the trainer through :mod:`launch.local` in a fresh
work directory and reports the seconds from launch to the first progress line
(runtime start-up, data, compile and the first loop) and the steps/s of the
last logged window (from ``metrics.jsonl``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run(processes: int, cpu_devices: int, trainer_args: list[str]) -> dict:
    """One launch; returns its start-up time and final steps/s."""
    workdir = tempfile.mkdtemp(prefix=f"launch_bench_p{processes}_")
    cmd = [
        sys.executable,
        "-m",
        "launch.local",
        f"--num_processes={processes}",
        f"--cpu_devices={cpu_devices}",
        "--",
        *trainer_args,
        f"--workdir={workdir}",
    ]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    first_step = None
    for line in proc.stdout:
        if first_step is None and "] step " in line:
            first_step = time.perf_counter() - start
    if proc.wait():
        raise RuntimeError(f"{processes} processes failed (exit {proc.returncode})")
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return {
        "processes": processes,
        "first_step_s": first_step,
        "steps_per_sec": rows[-1]["steps_per_sec"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launch.bench",
        description=__doc__.split("\n")[0],
        epilog="example: python -m launch.bench --processes 1,2 -- --config "
        "configs/transformer_1024.py:tiny --config.num_train_steps=40",
    )
    parser.add_argument(
        "--processes", default="1,2,4", help="process counts to time (default %(default)s)"
    )
    parser.add_argument(
        "--cpu_devices", type=int, default=8, help="CPU devices of each job (default %(default)s)"
    )
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="after --: the flags of python -m trainer"
    )
    args = parser.parse_args()
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    results = [run(int(p), args.cpu_devices, trainer_args) for p in args.processes.split(",")]
    base = results[0]["steps_per_sec"]
    for r in results:
        print(
            f"{r['processes']} process(es): first step after {r['first_step_s']:.1f}s, "
            f"{r['steps_per_sec']:.2f} steps/s (x{r['steps_per_sec'] / base:.2f})"
        )


if __name__ == "__main__":
    main()
