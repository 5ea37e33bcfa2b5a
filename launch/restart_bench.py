"""Seconds from start to the first step of a restarted run, with and without the compilation cache.

    python -m launch.restart_bench --steps 4 --repeats 3 -- \\
        --config configs/transformer_1024.py:tiny --cpu_devices 8 \\
        --config.steps_per_loop=4 --config.log_every_steps=4 --config.eval_every_steps=0

Trains ``--steps`` steps once in a fresh work directory (a checkpoint and a
filled ``compilation_cache/``) and keeps a copy of it. Each restart puts that
copy back in the same place (XLA's compile options, part of the cache key,
name the cache directory) and trains to ``3 x --steps`` (so the first progress
line, at ``2 x --steps``, is not the final step's eval), alternately with the
cache and without one (``compilation_cache_dir=''``). Reports the seconds from
launch to the first progress line of each restart (start-up, restore, compile,
one loop; the run is then killed) and the loop's reported compile time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _run(
    trainer_args: list[str], workdir: str, steps: int, *extra: str, measure_only: bool = False
) -> tuple[float, float]:
    """One trainer run; returns (seconds to the first progress line, loop compile seconds).

    With ``measure_only`` the run is killed at its first progress line.
    """
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        *trainer_args,
        f"--workdir={workdir}",
        f"--config.num_train_steps={steps}",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    first_step, compile_s, lines = None, float("nan"), []
    for line in proc.stdout:
        lines.append(line)
        # The trainer's line "compiling a loop of K steps: compiled in 1m02s" (or 6.4s).
        if match := re.search(r"steps: compiled in (?:(\d+)m)?([\d.]+)s", line):
            compile_s = 60 * int(match.group(1) or 0) + float(match.group(2))
        if first_step is None and line.startswith("step "):
            first_step = time.perf_counter() - start
            if measure_only:
                proc.kill()  # the rest of the run is not measured
                break
    proc.wait()
    if first_step is None or (proc.returncode and not measure_only):
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{''.join(lines)[-3000:]}")
    return first_step, compile_s


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m launch.restart_bench",
        description=__doc__.split("\n")[0],
        epilog="example: python -m launch.restart_bench --steps 4 -- --config "
        "configs/transformer_1024.py:tiny --cpu_devices 8",
    )
    parser.add_argument(
        "--steps", type=int, default=4, help="steps before the restart (default %(default)s)"
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="restarts of each kind (default %(default)s)"
    )
    parser.add_argument(
        "trainer_args", nargs=argparse.REMAINDER, help="after --: the flags of python -m trainer"
    )
    args = parser.parse_args()
    trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    root = tempfile.mkdtemp(prefix="restart_bench_")
    try:
        workdir, saved = os.path.join(root, "run"), os.path.join(root, "saved")
        _run(trainer_args, workdir, args.steps)
        shutil.copytree(workdir, saved)
        results: dict[str, list[tuple[float, float]]] = {"cache": [], "no cache": []}
        for _ in range(args.repeats):
            for kind in results:  # alternate, so drift hits both alike
                shutil.rmtree(workdir)
                shutil.copytree(saved, workdir)
                extra = []
                if kind == "no cache":
                    shutil.rmtree(os.path.join(workdir, "compilation_cache"))
                    extra = ["--config.compilation_cache_dir="]
                results[kind].append(
                    _run(trainer_args, workdir, 3 * args.steps, *extra, measure_only=True)
                )
                print(
                    f"{kind:>8}: first step after {results[kind][-1][0]:.1f}s "
                    f"(loop compile {results[kind][-1][1]:.1f}s)",
                    flush=True,
                )
        medians = {k: statistics.median(t for t, _ in v) for k, v in results.items()}
        for kind, runs in results.items():
            print(
                f"{kind:>8}: median {medians[kind]:.1f}s to the first step "
                f"({', '.join(f'{t:.1f}' for t, _ in runs)}); loop compile "
                f"{', '.join(f'{c:.1f}' for _, c in runs)}s"
            )
        cached, uncached = results["cache"], results["no cache"]
        pairs = [n / c for (c, _), (n, _) in zip(cached, uncached, strict=True)]
        print(
            f"no cache / cache: {medians['no cache'] / medians['cache']:.2f} (medians), "
            f"pairwise {', '.join(f'{r:.2f}' for r in pairs)}"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
