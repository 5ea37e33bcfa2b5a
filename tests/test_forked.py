"""The command server of the suite (tests/forked.py) against a fresh interpreter: a
``python -m`` command run as its fork prints, exits and ends as one started anew."""

import subprocess
import sys

import pytest
from conftest import run_command

PROBE = [sys.executable, "-m", "tests.forked_probe"]


@pytest.mark.parametrize("case", ["plain", "thread", "code", "message"])
def test_a_forked_command_ends_as_a_fresh_one(case):
    forked, fresh = (run_command([*PROBE, case], timeout=60, fresh=f) for f in (False, True))
    assert (forked.returncode, forked.stdout, forked.stderr) == (
        fresh.returncode,
        fresh.stdout,
        fresh.stderr,
    )
    assert forked.stdout.startswith(f"as __main__ with ['{case}'], stdin ''\n")
    assert forked.stdout.endswith("atexit ran\n")


def test_an_uncaught_exception_is_a_traceback_and_exit_code_1():
    forked, fresh = (run_command([*PROBE, "raise"], timeout=60, fresh=f) for f in (False, True))
    assert forked.returncode == fresh.returncode == 1
    # The frames above the module's differ (runpy's as -m runs it, the server's here).
    assert forked.stderr.splitlines()[-1] == fresh.stderr.splitlines()[-1]
    assert forked.stderr.splitlines()[-1] == "ValueError: uncaught"
    assert "Traceback" in forked.stderr


def test_a_forked_command_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        run_command([*PROBE, "sleep"], timeout=1)
