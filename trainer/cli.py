"""Command-line plumbing shared by ``python -m trainer`` and ``trainer.bench``.

Turns the ways a user can get the input wrong into one line on stderr and a
non-zero exit, and prepares the JAX runtime before any device is touched.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from collections.abc import Iterator

from absl import flags

EXIT_USAGE = 2
EXIT_ERROR = 1


def fail(message: str, code: int = EXIT_USAGE, *, last_words: bool = False) -> None:
    """Prints ``error: message`` (one line) to stderr and exits.

    Args:
      last_words: nothing this process prints afterwards reaches the user (for
        a failed save, whose other writers die printing tracebacks at exit).
    """
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    if last_words:
        from trainer import signals  # noqa: PLC0415

        signals.silence()
    sys.exit(code)


def reject_arguments(argv: list[str]) -> None:
    """Exits with a usage error if anything but flags was given (argv[0] is the program)."""
    if len(argv) > 1:
        fail(f"unexpected arguments: {' '.join(argv[1:])}")


def _config_overrides(argv: list[str]) -> list[str]:
    return [m.group(1) for a in argv if (m := re.match(r"--config\.([\w.]+)", a))]


def _config_files(argv: list[str]) -> list[str]:
    """The values of ``--config`` (``--config X`` or ``--config=X``)."""
    files = []
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            files.append(argv[i + 1])
        elif arg.startswith("--config="):
            files.append(arg.split("=", 1)[1])
    return files


def _unknown_key(text: str, argv: list[str]) -> str:
    """The one-line message for an unknown ``--config.a.b`` (ml_collections reports
    only the leaf, quoted, perhaps with a suggestion)."""
    plain = text.replace("\\", "")
    names = re.findall(r"'([\w.]+)'", plain)
    leaf = names[0].split(".")[-1] if names else ""
    keys = [k for k in _config_overrides(argv) if k.split(".")[-1] == leaf] or [leaf or "?"]
    message = f"unknown config key '{keys[0]}' (from --config.{keys[0]}=...)"
    suggestion = re.search(r'Did you mean "([\w.]+)"', plain)
    if suggestion:
        prefix = keys[0].rsplit(".", 1)[0] + "." if "." in keys[0] else ""
        message += f"; did you mean '{prefix}{suggestion.group(1)}'?"
    return message


def parse_flags(argv: list[str]) -> list[str]:
    """absl flag parsing with one-line errors (for ``app.run(flags_parser=...)``).

    Config files are loaded here too (ml_collections loads them lazily, and a
    missing file would otherwise surface later as a traceback).
    """
    try:
        rest = flags.FLAGS(argv)
    except AttributeError as e:
        fail(_unknown_key(str(e), argv))
    except flags.UnrecognizedFlagError as e:
        if "'config." in str(e):
            fail(_unknown_key(str(e).replace("config.", ""), argv))
        fail(str(e))
    except flags.Error as e:
        text = str(e)
        if "Error whilst parsing config file" in text:
            # Keep the config's own message, the last line of the embedded traceback.
            last = [line for line in text.strip().splitlines() if line.strip()][-1]
            fail(f"{text.split(':', 1)[0]}: {last.strip()}")
        fail(text)
    for value in _config_files(argv):
        path = value.split(":", 1)[0]
        if not os.path.isfile(path):
            fail(f"--config {value}: no such file {path!r}")
    try:
        flags.FLAGS.flag_values_dict()  # loads the config files
    except Exception as e:  # noqa: BLE001  (whatever the config file raised)
        fail(f"--config: {e}")
    return rest


def init_runtime(
    *,
    cpu_devices: int = 0,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = 100,
) -> None:
    """Configures JAX and storage before the first device or file is touched.

    Starts JAX's multi-controller runtime when this is one process of several:
    with the explicit coordinator flags, or wherever JAX recognises the
    environment (TPU pods and slices, SLURM, Open MPI; see :mod:`trainer.cluster`).

    Args:
      cpu_devices: if > 0, expose this many CPU devices (CPU-only hosts).
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the job.
      process_id: this process's index.
      heartbeat_timeout_s: a process silent this long is taken for dead, and
        the others fail instead of waiting forever.
    """
    from trainer import storage  # noqa: PLC0415  (after flag parsing, like jax)

    if cpu_devices < 0:
        fail(f"--cpu_devices must be >= 0 (0 = the platform's devices), got {cpu_devices}")
    storage.configure()  # before any library opens a gs:// path
    import jax  # noqa: PLC0415  (here, so flags are parsed first)

    if cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    from trainer import cluster, errors  # noqa: PLC0415  (import jax)

    try:
        job = cluster.detect(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            timeout_s=max(heartbeat_timeout_s, 60),
        )
    except errors.ConfigError as e:
        fail(str(e))
    if job is not None:
        cluster.initialize(job, heartbeat_timeout_s=heartbeat_timeout_s)


# File-system errors a user's environment causes (not bugs): one line each.
_ENVIRONMENT_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES)


@contextlib.contextmanager
def clear_errors() -> Iterator[None]:
    """Reports the errors a user can cause as one line; anything else is a bug
    and keeps its traceback."""
    from trainer import errors  # noqa: PLC0415

    try:
        yield
    except errors.UserError as e:
        fail(str(e), EXIT_ERROR, last_words=e.last_words)
    except OSError as e:
        if e.errno not in _ENVIRONMENT_ERRNOS:
            raise
        fail(f"{e.strerror}: {e.filename or e}", EXIT_ERROR)
