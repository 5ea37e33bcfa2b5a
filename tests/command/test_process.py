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


_FRAGMENTED_HEAP = """
import ctypes, os
from trainer.command import process

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]

def resident_mib():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

# 4,096 blocks of 32 KiB (under glibc's mmap threshold: from the heap), written, then
# all but every 64th freed: 126 MiB free in the heap, held by the blocks between.
blocks = [libc.malloc(32 * 1024) for _ in range(4096)]
for b in blocks:
    ctypes.memset(b, 1, 32 * 1024)
for i, b in enumerate(blocks):
    if i % 64:
        libc.free(b)
before = resident_mib()
process.release_freed_memory()
print(before, resident_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_goes_back_to_the_system():
    result = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP],
        cwd=REPO,
        env=command_env(),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = map(float, result.stdout.split())
    assert before - after > 100, (before, after)
