"""The command server of the suite (tests/forked.py) against a fresh interpreter: a
``python -m`` command run as its fork prints, exits and ends as one started anew."""

import os
import subprocess
import sys

import pytest
from conftest import run_command


def probe(case: str) -> list[str]:
    return [sys.executable, "-m", "tests.forked_probe", case, str(os.getpid())]


def both(case: str) -> tuple:
    """The probe run as a fork of the command server, then as a fresh interpreter."""
    forked, fresh = (run_command(probe(case), timeout=60, fresh=f) for f in (False, True))
    # The first line says which it was: each test's command goes to the server
    # (pytest's per-test variable once kept all but the first test's from it).
    assert forked.stdout.split("\n")[0] == "forked", forked.stdout
    assert fresh.stdout.split("\n")[0] == "fresh", fresh.stdout
    return forked, fresh


@pytest.mark.parametrize("case", ["plain", "thread", "code", "message"])
def test_a_forked_command_ends_as_a_fresh_one(case):
    forked, fresh = both(case)
    assert (forked.returncode, forked.stdout.split("\n")[1:], forked.stderr) == (
        fresh.returncode,
        fresh.stdout.split("\n")[1:],
        fresh.stderr,
    )
    assert forked.stdout.split("\n")[1] == f"as __main__ with ['{case}'], stdin ''"
    assert forked.stdout.endswith("atexit ran\n")


def test_an_uncaught_exception_is_a_traceback_and_exit_code_1():
    forked, fresh = both("raise")
    assert forked.returncode == fresh.returncode == 1
    # The frames above the module's differ (runpy's as -m runs it, the server's here).
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
    assert forked.stderr.splitlines()[-1] == "ValueError: uncaught"
    assert "Traceback" in forked.stderr


def test_a_forked_command_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_command(probe("sleep"), timeout=1)
