"""Command-line plumbing shared by ``python -m trainer`` and ``trainer.bench``.

Turns the ways a user can get the input wrong into one line on stderr and a
non-zero exit, and prepares the JAX runtime before any device is touched.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Iterator

from absl import flags

EXIT_USAGE = 2
EXIT_ERROR = 1


def fail(message: str, code: int = EXIT_USAGE) -> None:
    """Prints ``error: message`` (one line) to stderr and exits."""
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    sys.exit(code)


def _config_overrides(argv: list[str]) -> list[str]:
    return [m.group(1) for a in argv if (m := re.match(r"--config\.([\w.]+)", a))]


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (for ``app.run(flags_parser=...)``)."""
    try:
        return flags.FLAGS(argv)
    except AttributeError as e:
        # ml_collections reports an unknown --config.a.b as a bare KeyError('b').
        match = re.search(r"'([^']+)'", str(e))
        leaf = match.group(1) if match else str(e)
        keys = [k for k in _config_overrides(argv) if k.split(".")[-1] == leaf] or [leaf]
        fail(f"unknown config key '{keys[0]}' (from --config.{keys[0]}=...)")
    except flags.Error as e:
        text = str(e)
        if "Error whilst parsing config file" in text:
            # Keep the config's own message, the last line of the embedded traceback.
            last = [line for line in text.strip().splitlines() if line.strip()][-1]
            fail(f"{text.split(':', 1)[0]}: {last.strip()}")
        fail(text)
    return []


def _cluster_detected() -> bool:
    """Whether a scheduler started this process as one of several (JAX then
    finds the coordinator itself: TPU pod metadata, SLURM variables)."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return True
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


def init_runtime(
    *,
    cpu_devices: int = 0,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Configures JAX before the first device is touched.

    Starts JAX's multi-controller runtime when this is one process of several:
    with the explicit coordinator flags, or auto-detected on TPU pods and SLURM.

    Args:
      cpu_devices: if > 0, expose this many CPU devices (CPU-only hosts).
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the job.
      process_id: this process's index.
      heartbeat_timeout_s: a process silent this long is taken for dead, and
        the others fail instead of waiting forever.
    """
    import jax  # noqa: PLC0415  (import here so flags are parsed first)

    if cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    explicit = coordinator_address is not None
    if explicit and (num_processes is None or process_id is None):
        fail("--coordinator_address needs --num_processes and --process_id")
    if explicit or _cluster_detected():
        jax.distributed.initialize(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            heartbeat_timeout_seconds=heartbeat_timeout_s,
            initialization_timeout=max(heartbeat_timeout_s, 60),
        )


@contextlib.contextmanager
def clear_errors() -> Iterator[None]:
    """Reports the errors a user can cause as one line; anything else is a bug
    and keeps its traceback."""
    from trainer import checkpoint, errors, train  # noqa: PLC0415
    from trainer.data import translation  # noqa: PLC0415

    user_errors = (
        errors.ConfigError,  # includes mesh and sharding-rule errors
        train.NonFiniteLossError,
        checkpoint.CheckpointError,
        translation.DatasetNotPreparedError,
    )
    try:
        yield
    except user_errors as e:
        fail(str(e), EXIT_ERROR)
