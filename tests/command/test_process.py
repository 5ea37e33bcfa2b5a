"""The process a command sets up: on a CPU host with the TPU runtime installed (the
README's test command installs it), no command starts libtpu."""

import importlib.util
import subprocess
import sys

import pytest
from conftest import REPO, command_env

_PROBE = """
from trainer.command import process
process.setup()
import jax
print(jax.devices()[0].platform, jax.config.jax_platforms)
"""


@pytest.mark.skipif(
    importlib.util.find_spec("libtpu") is None, reason="libtpu not installed ('.[tpu]')"
)
def test_a_cpu_host_with_libtpu_installed_never_starts_it():
    env = {k: v for k, v in command_env().items() if k != "JAX_PLATFORMS"}
    result = subprocess.run(
        [sys.executable, "-c", _PROBE], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["cpu", "cpu"]
    # What libtpu prints when it looks for a TPU and finds none.
    for line in ("TPU_WORKER_HOSTNAMES", "Failed to find host bounds", "E0000"):
        assert line not in result.stderr, result.stderr[-3000:]
