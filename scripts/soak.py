"""Soak test of stopping and resuming: N runs stopped at random, each resumed.

    python scripts/soak.py --count 30 [--seed 0] [--dir /tmp/soak] [--processes 2]

First one uninterrupted run of the tiny Transformer (the reference). Then, in
one work directory, runs that are each stopped at random: an external SIGKILL,
SIGTERM, Ctrl-C or Ctrl-C twice after a random delay, or an injected fault at a
random pass through a random point (``WUS_FAULT``: compile, loop, mid-save,
eval; kill, term, int, int2 or a full disk; see trainer/faults.py). Every run
resumes what the previous left. After each run the script checks: no traceback,
at most one ``error:`` line per process, the exit code the stop implies, only
complete checkpoints listed, and the newest one the run names is the newest
listed. Each time a run reaches the last step, its metrics (every row, timing
fields aside) must equal the reference's; the work directory then starts afresh.
Each run stopped by an external signal says how long the job took to exit after
it, and the summary gives the median and longest for SIGTERM.

``--processes 2`` runs every job (the reference too) as 2 processes of 4 CPU
devices under ``launch.local``; an external SIGKILL or SIGTERM then goes to the
launcher or to one trainer process at random (Ctrl-C to the launcher, as a
terminal sends it), and an injected fault happens in every process. A run after a
killed launcher finds its processes still saving: it must wait for them.

Prints one line per run and a summary; exits 1 if any check failed. The logs of
every run stay under ``--dir``.

    python scripts/soak.py --tests --count 3

runs the suite's deterministic versions instead (the tests marked ``soak``: kills,
signals, a frozen peer, a full disk, each at a fixed point), ``--count`` rounds in a
row, and stops at the first round that fails. CI runs one round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 16
TIMING = {"steps_per_sec", "examples_per_sec", "mfu", "tokens_per_sec", "step_time_s", "time"}
# Injection points and how many times a run from step 0 passes each (compile once,
# a loop and a save every 2 steps, one eval batch every 8 steps).
PASSES = {"compile": 1, "loop": STEPS // 2, "save": STEPS // 2, "eval": STEPS // 8}
ACTIONS = ("kill", "term", "int", "int2", "enospc")
SIGNALS = {
    "kill": [signal.SIGKILL],
    "term": [signal.SIGTERM],
    "int": [signal.SIGINT],
    "int2": [signal.SIGINT, signal.SIGINT],
}


def expected_codes(way: str, out: str, target: str) -> set[int]:
    """The exit codes a run stopped ``way`` may give, given what it printed (a
    fault at a pass the run never reaches, or a signal after the end, does nothing).

    ``target`` is who got the signal: "trainer" (the one process of a single-process
    run), "launcher", or "process" (one trainer process under the launcher, or an
    injected fault in each). The launcher exits with its first failed process's code,
    1 for one killed by a signal.
    """
    if way == "kill":
        return {-9, 0} if target in ("trainer", "launcher") else {1, 0}
    if way in ("int", "int2"):
        return {130} if "Ctrl-C" in out else {0}
    if way == "enospc":
        return {1} if "No space left on device" in out else {0}
    return {0}  # term, or no stop at all


def command(workdir: str, args) -> list[str]:
    """The run as a user types it; tests/conftest.py:tiny_command builds the same for the
    tests, but this script is run on its own, without the tests on its path."""
    flags = [
        "--config",
        "configs/transformer_1024.py:tiny",
        "--workdir",
        workdir,
        f"--config.data.data_dir={args.data_dir}",
        f"--config.compilation_cache_dir={args.cache}",
        f"--config.num_train_steps={STEPS}",
        "--config.steps_per_loop=2",
        "--config.log_every_steps=2",
        "--config.eval_every_steps=8",
        "--config.checkpoint_every_steps=2",
        "--config.data.num_eval_examples=16",
        "--config.max_decode_length=8",
    ]
    if args.processes == 1:
        return [sys.executable, "-m", "trainer", *flags, "--cpu_devices", "8"]
    launch = ["launch.local", f"--num_processes={args.processes}", "--cpu_devices=8"]
    # A dead peer is found within 15 s, and a dead launcher's processes are gone in 10.
    return [sys.executable, "-m", *launch, "--grace=10", "--", *flags, "--heartbeat_timeout=15"]


def start(workdir: str, args, fault: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO)
    env.pop("XLA_FLAGS", None)
    env.pop("WUS_FAULT", None)
    if fault:
        env["WUS_FAULT"] = fault
    return subprocess.Popen(
        command(workdir, args),
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def trainer_processes(launcher: int) -> list[int]:
    """The trainer processes ``launch.local`` (pid ``launcher``) started."""
    found = subprocess.run(["pgrep", "-P", str(launcher)], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def rows(workdir: str) -> dict[int, dict]:
    """The metrics rows by step, timing fields aside (each step must appear once)."""
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    out: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if row["step"] in out:
                raise AssertionError(f"step {row['step']} logged twice")
            out[row["step"]] = {k: v for k, v in row.items() if k not in TIMING}
    return out


def listed(workdir: str) -> list[int]:
    directory = os.path.join(workdir, "checkpoints")
    names = os.listdir(directory) if os.path.isdir(directory) else []
    return sorted(int(n) for n in names if n.isdigit())


def check(workdir: str, way: str, target: str, code: int, out: str, processes: int) -> list[str]:
    """The problems with one run's outcome (empty if none)."""
    problems = []
    if "Traceback" in out:
        problems.append("traceback in the output")
    lines = [re.sub(r"^\[p\d+\] ", "", line) for line in out.splitlines()]  # launch.local's
    errors = [line for line in lines if line.startswith("error:")]
    if len(errors) > processes:
        problems.append(f"{len(errors)} error lines")
    ended = f"newest complete checkpoint: step {STEPS} " in out  # the run's last line
    if code in (-signal.SIGINT, -signal.SIGTERM) and ended and way in ("int", "int2", "term"):
        pass  # the signal came during the interpreter's exit, after the run ended
    elif code not in (allowed := expected_codes(way, out, target)):
        problems.append(f"exit code {code}, expected one of {sorted(allowed)}")
    if way == "enospc" and code == 1 and "No space left on device" not in "".join(errors):
        problems.append(f"full disk not named: {errors}")
    steps = listed(workdir)
    incomplete = [
        step
        for step in steps
        if not os.path.exists(os.path.join(workdir, "checkpoints", str(step), "commit_success.txt"))
    ]
    # A kill while retention deletes an old checkpoint leaves part of it (Orbax
    # deletes in place); harmless while a newer complete one exists.
    if incomplete and max(incomplete) == max(steps):
        problems.append(f"the newest checkpoint {max(steps)} is not complete")
    named = re.findall(r"newest complete checkpoint: step (\d+)", out)
    # After a SIGKILL the processes left may still save (a killed launcher's do).
    if named and way != "kill" and int(named[-1]) != max(steps, default=-1):
        problems.append(f"says newest is {named[-1]} but {steps} are listed")
    return problems


def soak_tests(count: int) -> int:
    """``pytest -m soak`` ``count`` times; the exit code of the first round that fails."""
    for round_ in range(1, count + 1):
        start_s = time.time()
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-m", "soak", "--durations=10"], cwd=REPO
        )
        verdict = "passed" if result.returncode == 0 else f"failed (exit {result.returncode})"
        print(f"round {round_}/{count}: {verdict} in {time.time() - start_s:.0f}s", flush=True)
        if result.returncode:
            return result.returncode
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--count", type=int, required=True, help="runs stopped at random (rounds with --tests)"
    )
    parser.add_argument(
        "--tests", action="store_true", help="run the tests marked soak --count times instead"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default="/tmp/wus-soak", help="work area (emptied first)")
    parser.add_argument(
        "--processes", type=int, default=1, help="trainer processes per job (launch.local)"
    )
    args = parser.parse_args()
    if args.count < 1 or args.processes < 1 or 8 % args.processes:
        print(
            f"error: --count ({args.count}) must be >= 1 and --processes ({args.processes}) "
            "must divide 8 devices",
            file=sys.stderr,
        )
        return 2
    if args.tests:
        return soak_tests(args.count)
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    args.data_dir = os.path.join(args.dir, "tfds")
    args.cache = os.path.join(args.dir, "compilation_cache")
    rng = random.Random(args.seed)

    start_s = time.time()
    if args.processes > 1:  # the processes of a job find their input ready, as on a pod
        prepare = [sys.executable, "-m", "trainer.data.prepare"]
        prepare += ["--config", "configs/transformer_1024.py:tiny"]
        prepare += [f"--config.data.data_dir={args.data_dir}"]
        env = dict(os.environ, PYTHONPATH=REPO)
        subprocess.run(prepare, cwd=REPO, env=env, check=True, capture_output=True)
    reference_dir = os.path.join(args.dir, "reference")
    proc = start(reference_dir, args, None)
    out = proc.communicate()[0]
    if proc.returncode != 0:
        print(out[-3000:])
        print("error: the reference run failed", file=sys.stderr)
        return 1
    reference = rows(reference_dir)
    print(f"reference: {len(reference)} rows, {time.time() - start_s:.0f}s", flush=True)

    workdir = os.path.join(args.dir, "run")
    failures, finished, compared, stopped_runs = 0, 0, 0, 0
    term_exits: list[float] = []  # seconds from an external SIGTERM to the job's exit
    run_index = 0
    while stopped_runs < args.count or finished == 0 or os.path.exists(workdir):
        last = stopped_runs >= args.count  # all stops done: run to the end
        run_index += 1
        alone = args.processes == 1
        target = "trainer" if alone else "process"
        if last:
            way, fault, delay = "none", None, None
        elif rng.random() < 0.5:
            way = rng.choice(ACTIONS)
            where = rng.choice(sorted(PASSES))
            fault = f"{where}:{way}:{rng.randint(1, PASSES[where])}"
            delay = None
        else:
            way = rng.choice(("kill", "term", "int", "int2"))
            fault, delay = None, rng.uniform(2.0, 25.0 if alone else 50.0)
            if not alone:  # a terminal's Ctrl-C reaches the launcher only
                is_int = way in ("int", "int2")
                target = "launcher" if is_int or rng.random() < 0.5 else "process"
        began = time.time()
        before = listed(workdir)
        proc = start(workdir, args, fault)
        signalled = None  # when the signal went out, if it reached a running job
        if delay is not None:
            try:
                proc.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                pids = [proc.pid] if target != "process" else trainer_processes(proc.pid)[:1]
                signalled = time.time()
                for signum in SIGNALS[way]:
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signum)
                    time.sleep(0.05)
        out = proc.communicate(timeout=600)[0]
        to_exit = None if signalled is None else time.time() - signalled
        with open(os.path.join(args.dir, f"run{run_index:03d}.log"), "w") as f:
            f.write(
                f"# fault={fault} way={way} target={target} delay={delay} "
                f"rc={proc.returncode}\n{out}"
            )
        if not last:
            stopped_runs += 1
        problems = check(workdir, way, target, proc.returncode, out, args.processes)
        try:
            got = rows(workdir)
        except AssertionError as e:
            problems.append(str(e))
            got = {}
        done = STEPS in listed(workdir) and STEPS in got
        if done:
            finished += 1
            mismatched = [s for s in reference if got.get(s) != reference[s]]
            if mismatched:
                problems.append(f"metrics differ from the reference at steps {mismatched}")
            else:
                compared += 1
        what = fault or (
            f"{way} {'' if alone else target + ' '}after {delay:.1f}s"
            if delay is not None
            else "to the end"
        )
        if to_exit is not None and way == "term":
            term_exits.append(to_exit)
        print(
            f"run {run_index:3d}: {what:32s} rc {proc.returncode:4d} | checkpoints {before} -> "
            f"{listed(workdir)} | {time.time() - began:4.0f}s"
            f"{f' | exit {to_exit:.1f}s after the signal' if to_exit is not None else ''}"
            f"{' | finished, equal to the reference' if done and not problems else ''}"
            f"{' | PROBLEMS: ' + '; '.join(problems) if problems else ''}",
            flush=True,
        )
        failures += bool(problems)
        if last and not done:
            break  # the run to the end did not get there (reported above)
        if done:
            shutil.rmtree(workdir)  # start afresh
    print(
        f"soak: {stopped_runs} stopped runs, {run_index} runs in all, {finished} reached the "
        f"last step ({compared} equal to the reference), {failures} with problems, "
        f"{time.time() - start_s:.0f}s",
        flush=True,
    )
    if term_exits:
        median = sorted(term_exits)[len(term_exits) // 2]
        print(
            f"SIGTERM to exit: {len(term_exits)} runs, median {median:.1f}s, "
            f"longest {max(term_exits):.1f}s (the loop in flight finishes, then the save)",
            flush=True,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
