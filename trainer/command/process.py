"""Everything a command changes about its process, in one place.

The library computes and changes no interpreter state: a command (``python -m
trainer``, ``trainer.evaluate``, ...) calls :func:`setup` once its flags are
parsed, and :func:`run` instead of ``absl.app.run``. ``python -m trainer`` also
installs the stop handling (:func:`trainer.command.signals.install`) before its
slow imports and points JAX's compilation cache at the run's
(:func:`use_compilation_cache`).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import glob
import importlib.util
import logging as std_logging
import os
import sys
from collections.abc import Callable
from typing import IO

from absl import app, logging
from etils import epath

from trainer import console
from trainer.checkpoint import orbax_output
from trainer.command import cli
from trainer.errors import ConfigError
from trainer.reporting import metrics
from trainer.workdir import storage


def release_freed_memory() -> None:
    """Hands the memory the C heap holds freed back to the system (glibc's
    ``malloc_trim``); nothing where the C library has none.

    XLA's compiler allocates and frees gigabytes on the threads that compile, and
    glibc keeps what they free in its arenas, where it counts as the process's
    resident memory until reused. Trimmed after the training loop's compile, the 64M
    decoder's resident memory while training on 8 CPU devices went from 3.31 to
    3.09 GiB under ``per_layer`` (``scripts/maxtext_side_by_side.py``).
    """
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: musl, macOS
        return
    trim(0)


def setup(
    *,
    cpu_devices: int = 0,
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout_s: int = 100,
    console_stream: IO[str] | None = None,
    compiles_for_tpu: bool = False,
    writes_events: bool = False,
) -> None:
    """Sets the process up before the first device or file is touched.

    * Library logging: warnings and errors only (TFDS and Orbax INFO lines would
      drown the progress lines), and what Orbax prints about faults the run
      reports itself goes (:mod:`trainer.checkpoint.orbax_output`). C++ logs
      (XLA, libtpu) keep errors only, and TFDS draws no bars of its own: the
      console (:mod:`trainer.console`) says what each phase does, on
      process 0 only.
    * Storage: ``gs://`` through a local emulator if ``STORAGE_EMULATOR_HOST`` says so,
      and TensorBoard event files in object stores through etils.epath (where the
      command writes them).
    * JAX: ``cpu_devices`` CPU devices if asked; JAX's multi-controller runtime when
      this is one process of several, with the explicit coordinator flags or
      wherever JAX recognises the environment (:mod:`trainer.command.cluster`).

    Args:
      cpu_devices: if > 0, expose this many CPU devices (CPU-only hosts).
      coordinator_address: ``host:port`` of process 0's coordinator service.
      num_processes: number of processes in the job.
      process_id: this process's index.
      heartbeat_timeout_s: a process of the job silent this long is taken for lost:
        the others stop in one line (:mod:`trainer.command.peers`, which also sets
        JAX's own timeouts from it).
      console_stream: where the console goes (default stdout; stderr for a
        command whose stdout is its result).
      compiles_for_tpu: the command compiles for TPU topologies it does not run on
        (``trainer.aot``). On a host without TPU chips libtpu then starts as a lone
        worker (``TPU_WORKER_HOSTNAMES=localhost``, ``TPU_HOST_BOUNDS=1,1,1``) instead
        of printing five lines about the workers and host bounds it cannot find; the
        programs it compiles are the same byte for byte.
      writes_events: the command writes TensorBoard events (training, evaluation):
        their writers are routed through etils.epath, which imports tensorboardX
        (0.6 s) that other commands leave out; without torch (see
        :func:`_without_torch`).
    """
    if cpu_devices < 0:
        cli.fail(f"--cpu_devices must be >= 0 (0 = the platform's devices), got {cpu_devices}")
    _quiet_libraries()
    orbax_output.quiet()
    storage.configure()
    if writes_events:
        with _without_torch():
            metrics.route_event_files_through_epath()  # TensorBoard events in object stores too
    import jax  # noqa: PLC0415  (a command's --help and flag mistakes need no JAX)
    import tensorflow_datasets as tfds  # noqa: PLC0415  (seconds to import)

    from trainer.command import cluster, peers  # noqa: PLC0415  (imports JAX)

    if compiles_for_tpu:
        # libtpu takes a machine-wide lock when it loads, meant for processes that
        # drive the TPU chips; compiling drives none, so several compiling processes
        # may share a host.
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if compiles_for_tpu and not _tpu_on_this_host():
        os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        os.environ.setdefault("TPU_HOST_BOUNDS", "1,1,1")
    if cpu_devices:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", cpu_devices)
    elif not jax.config.jax_platforms and (platforms := _platforms_without_tpu()):
        jax.config.update("jax_platforms", platforms)
    try:
        job = cluster.detect(
            coordinator_address=coordinator_address,
            num_processes=num_processes,
            process_id=process_id,
            timeout_s=max(heartbeat_timeout_s, 60),
        )
    except ConfigError as e:
        cli.fail(str(e))
    if job is not None:
        # JAX's preemption service (on by default) installs a C-level SIGTERM handler
        # that replaces the command's own (trainer/command/signals.py): a SIGTERM then
        # only sets a flag inside JAX, read by reached_preemption_sync_point(n), whose
        # sync point (the highest n any process last passed, plus 1) is met only by a
        # loop that calls it with n, n+1, n+2, ... Orbax's saves call it with their
        # step too, which moves that counter. The trainer stops every process itself
        # (stopping.Run.should_stop gathers each process's stop request at every loop
        # boundary), so the signal stays the command's. The service's only notifier
        # is that SIGTERM handler: nothing else is lost.
        jax.config.update("jax_enable_preemption_service", False)
        timeouts = peers.runtime_timeouts(heartbeat_timeout_s)
        cluster.initialize(
            job,
            heartbeat_timeout_s=timeouts["heartbeat_timeout_seconds"],
            shutdown_timeout_s=timeouts["shutdown_timeout_seconds"],
        )
        watch = peers.start(heartbeat_timeout_s, _peer_lost)
        if watch is not None:
            atexit.register(watch.leave)  # before JAX's own shutdown: registered after it
    # Process 0 speaks. Known without jax.process_index(), which would start the
    # backends (and libtpu's start-up lines) in commands that never use a device.
    console.setup(enabled=job is None or job.process_id == 0, stream=console_stream or sys.stdout)
    tfds.disable_progress_bar()


@contextlib.contextmanager
def _without_torch():
    """tensorboardX imports torch where it is installed (``tensorboardX/writer.py``: ``try:
    import torch``), only to accept torch tensors as values, which no command hands it.
    With PyPI's torch 2.13 (its CUDA build), on this project's 2-core machines, in turns
    with the code before this (farm-bench, medians): a mistake found in set-up takes
    3.3 s to say instead of 6.5, a 40-step run of a tiny decoder 13.7 s instead of 17.4
    at 645 instead of 1126 MiB resident. Within this block an import of torch fails as
    on a machine without it, which tensorboardX expects; afterwards torch imports as
    usual (the Hugging Face commands need it). Entered before the command starts any
    thread that could import torch meanwhile."""
    if "torch" in sys.modules:  # already imported (or already hidden): nothing to save
        yield
        return
    sys.modules["torch"] = None  # the import system's documented "not importable" entry
    try:
        yield
    finally:
        del sys.modules["torch"]


def _quiet_libraries() -> None:
    """Library logs and warnings down to what the console does not say itself."""
    logging.set_verbosity(logging.WARNING)
    logging.get_absl_logger().addFilter(_tfds_errors_only)
    # gcsfs logs a traceback for every failed attempt to reach a bucket; the command
    # says what failed, in one line.
    std_logging.getLogger("gcsfs").setLevel(std_logging.CRITICAL)
    # tensorboardX warns "NaN or Inf found in input tensor" for every such scalar it
    # writes; the run itself says what is not finite, in one line.
    std_logging.getLogger("tensorboardX.x2num").setLevel(std_logging.ERROR)
    # Read by XLA's and libtpu's C++ logging when they load (below): errors only.
    # (libtpu's "Failed to find host bounds" on a host without a TPU comes before its
    # logging starts: commands that use no device never load it, see console below.)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TPU_STDERR_LOG_LEVEL", "2")
    os.environ.setdefault("TPU_MIN_LOG_LEVEL", "2")
    # grain's workers hand batches over in shared memory. The batches still in flight
    # when the input stops are unlinked at exit by multiprocessing's resource tracker (a
    # process it starts later, with this environment), which calls them "leaked" in a
    # warning: nothing is left behind, so the warning is noise.
    if "resource_tracker" not in os.environ.get("PYTHONWARNINGS", ""):
        noise = "ignore:resource_tracker:UserWarning"
        os.environ["PYTHONWARNINGS"] = ",".join(
            filter(None, [os.environ.get("PYTHONWARNINGS"), noise])
        )


def _peer_lost(message: str) -> None:
    """A peer of the job is lost (:mod:`trainer.command.peers`): the command's stop-now
    handling, if it has one, leaves with one line; else this line, and exit 1."""
    from trainer.command import signals  # noqa: PLC0415  (imports nothing heavy)

    handling = signals.current()
    if handling is not None:
        handling.exit_now(message, code=cli.EXIT_ERROR, failed=True)
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    signals.silence()
    os._exit(cli.EXIT_ERROR)


_GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips on the PCI bus, as JAX's own detection looks
_NVIDIA_DEVICES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg")


def _platforms_without_tpu() -> str | None:
    """The JAX platforms of a host with the TPU runtime installed but no TPU chip:
    ``"cpu"`` (``"cuda,cpu"`` where NVIDIA's runtime and a GPU are there too); None
    (JAX's own choice) where libtpu is absent or a Google device is on the PCI bus.

    JAX tries every installed runtime at its first device query; libtpu, finding no
    chip, prints five ``E0000 ... TPU_WORKER_HOSTNAMES`` and "Failed to find host
    bounds" lines before JAX falls back to the CPU. A real TPU VM is left alone.
    """
    if importlib.util.find_spec("libtpu") is None or _tpu_on_this_host():
        return None
    gpu = importlib.util.find_spec("jax_cuda12_plugin") is not None and any(
        os.path.exists(d) for d in _NVIDIA_DEVICES
    )
    return "cuda,cpu" if gpu else "cpu"


def _tpu_on_this_host() -> bool:
    """Whether a Google device (a TPU chip) is on this host's PCI bus."""
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with contextlib.suppress(OSError), open(vendor) as f:
            if f.read().strip() == _GOOGLE_PCI_VENDOR:
                return True
    return False


def _tfds_errors_only(record) -> bool:
    # TFDS logs its bookkeeping as warnings ("Variant folder ... has no
    # dataset_info.json" before every embedded dataset is generated); its errors stay.
    return record.levelno >= std_logging.ERROR or "tensorflow_datasets" not in record.pathname


def use_compilation_cache(setting: str | None, workdir: epath.Path) -> epath.Path | None:
    """Points JAX's persistent compilation cache at ``setting`` before the first compile.

    A restarted run then loads its executables instead of compiling them again
    (minutes for big models on TPU).

    Args:
      setting: ``config.compilation_cache_dir``: a path or URL, None for
        ``<workdir>/compilation_cache``, or "" for no cache.
      workdir: the run directory.

    Returns:
      The cache directory, or None if caching is off or the directory cannot be
      written (said in a warning: JAX's own is a raw traceback per compile).
    """
    import jax  # noqa: PLC0415  (after setup)
    from jax.experimental.compilation_cache import compilation_cache as jax_cache  # noqa: PLC0415

    directory = None if setting == "" else storage.path(setting or workdir / "compilation_cache")
    if directory is not None and (problem := storage.unwritable(directory)):
        console.warn(
            f"compilation_cache_dir {directory} cannot be written ({problem}): compiling "
            "without the persistent cache"
        )
        directory = None
    wanted = None if directory is None else str(directory)
    if jax.config.jax_compilation_cache_dir != wanted:
        # JAX opens its cache once per process; an earlier use may have opened another.
        jax_cache.reset_cache()
        jax.config.update("jax_compilation_cache_dir", wanted)
    # Cache every executable: JAX's defaults skip compiles under 1 s, which on
    # CPU (and for the small jitted helpers) is most of them.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return directory


def run(main: Callable[[list[str]], None], *, flags_parser=cli.parse_flags) -> None:
    """``absl.app.run(main)`` for a command: one-line errors for its flags, and a
    Ctrl-C (in a command without the trainer's stop handling) ends it with the
    shell's code 130 and one line, not a traceback. ``--help`` prints the
    command's help (:func:`trainer.command.cli.help_text`) and exits 0 before
    any other flag is checked. A command whose module calls
    :func:`trainer.command.signals.quiet_start` first ends a Ctrl-C while it imports
    in one line too; from here on a Ctrl-C is Python's KeyboardInterrupt again."""
    from trainer.command import signals  # noqa: PLC0415  (imports nothing heavy)

    signals.end_quiet_start()
    if cli.help_requested(sys.argv):
        command = sys.modules["__main__"]
        spec = getattr(command, "__spec__", None)
        name = spec.name.removesuffix(".__main__") if spec else os.path.basename(sys.argv[0])
        sys.stdout.write(cli.help_text(command, f"python -m {name}"))
        sys.exit(0)

    def guarded(argv: list[str]) -> None:
        try:
            main(argv)
        except BaseException:
            # A stop-now under way in another thread (Ctrl-C twice, a lost peer) ends
            # the process with its own line: the main thread failing meanwhile on the
            # same cause (a collective whose peer left) says nothing.
            from trainer.command import signals  # noqa: PLC0415  (imports nothing heavy)

            if (handling := signals.current()) is not None:
                handling.wait_if_exiting()
            raise

    try:
        app.run(guarded, flags_parser=flags_parser)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr, flush=True)
        sys.exit(130)
    sys.exit(0)
