"""Test set-up: every test sees 8 simulated CPU devices, and every compile of the
suite goes through one persistent compilation cache.

The flags must be set before JAX initialises its backends, so they live here, at
import time of the first module pytest loads. Many tests compile the same tiny run
(in this process, in the other xdist worker, in the commands they start): the cache
(JAX's own, keyed by the program) compiles each once.

The suite's programs are tiny and run a few steps, so compiling them is most of its
time, and LLVM's optimisation of XLA:CPU's kernels is most of a compile: the tests'
own programs compile at LLVM's level 0 (:data:`COMPILE_FLAGS`), but for the few
whose training loops run longer than they compile (:data:`RUNS_LONG`). Their numbers
differ from the default level's in rounding only, which the tests' tolerances hold:
they compare against independent references, not against the bits of one level.
The commands the tests start compile at the default level, as a user's do (it saved
them nothing: their time is start-up and running).
"""

import os
import subprocess
import sys
import tempfile
import threading

# PyTorch (the Hugging Face tests' reference, in this process and in the commands and
# scripts they start) runs on one thread: the suite's two workers keep both cores busy,
# and torch's OpenMP threads then wait on each other (the Llama reference of
# test_torch_parity.py: 32-33 s on two threads beside one busy core, 10-12 s on one;
# 12.2 against 11.6 s on an idle box). XLA:CPU does not read it (the same run times).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The CPU matmul peak for MFU is measured once and cached (trainer/parallel/hardware.py):
# keep that cache out of the user's home.
os.environ["XDG_CACHE_HOME"] = os.path.join(tempfile.gettempdir(), "wus-trainer-test-cache")
COMPILE_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(
    (os.environ.get("XLA_FLAGS", ""), COMPILE_FLAGS, "--xla_force_host_platform_device_count=8")
).strip()
# The compile option (``config.compiler_options``) that gives one training loop back
# XLA:CPU's default LLVM level, 3: for the tests whose loops run longer than they
# compile, where level 0's slower kernels cost more than its faster compile saves (40
# steps of the tiny Transformer: 14 s at level 0, 5 s at level 3, for 2 s more compile).
RUNS_LONG = "xla_backend_optimization_level=3"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile for TPU topologies in this process and in the commands they start
# (trainer.command.process.setup sets the same for trainer.aot).
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
# Read by JAX at import, here and in every command a test starts (they inherit it).
COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), "wus-trainer-test-cache", "jax")
os.environ["JAX_COMPILATION_CACHE_DIR"] = COMPILATION_CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"

import forked  # noqa: E402  (the flags above must be set before anything can import JAX)
import ml_collections  # noqa: E402
import pytest  # noqa: E402

from configs import transformer_1024  # noqa: E402
from trainer.input.options import DataOptions  # noqa: E402

# The checkout under test: commands run from it and import it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A TFDS data directory shared by a module's runs (the embedded dataset is built once)."""
    return str(tmp_path_factory.mktemp("tfds"))


def tiny_translation(data_dir: str, **overrides):
    """The ``:tiny`` Transformer on the embedded data in ``data_dir``; ``overrides`` are
    flattened keys (``num_train_steps=20``, ``**{"optimizer.warmup_steps": 10}``)."""
    config = transformer_1024.get_config("tiny")
    config.data.data_dir = data_dir
    config.update_from_flattened_dict(overrides)
    return config


def tiny_flags(workdir, data_dir: str, **overrides) -> list[str]:
    """:func:`tiny_translation` as command-line flags, which ``python -m trainer`` takes
    and ``launch.local`` passes on after ``--``; each override is a ``--config.KEY=VALUE``.
    The run compiles through the suite's cache unless ``compilation_cache_dir`` is given."""
    overrides.setdefault("compilation_cache_dir", COMPILATION_CACHE)
    return [
        "--config=configs/transformer_1024.py:tiny",
        f"--workdir={workdir}",
        f"--config.data.data_dir={data_dir}",
        *(f"--config.{key}={value}" for key, value in overrides.items()),
    ]


def tiny_command(workdir, data_dir: str, **overrides) -> list[str]:
    """``python -m trainer`` with :func:`tiny_flags` on 8 CPU devices, as a user types it
    (run it from :data:`REPO` with :func:`command_env`)."""
    return [
        sys.executable,
        "-m",
        "trainer",
        "--cpu_devices=8",
        *tiny_flags(workdir, data_dir, **overrides),
    ]


def command_env(**variables: str) -> dict[str, str]:
    """The environment of a ``python -m ...`` command: this one's with :data:`REPO`
    importable and ``variables`` set, but neither this process's device count
    (XLA_FLAGS; a command sets its own with ``--cpu_devices``) nor the suite's
    :data:`COMPILE_FLAGS` (a command compiles as a user's does), nor an injected fault
    (WUS_FAULT, trainer/faults.py), nor pytest's name of the running test, which changes
    with every test (the command server's environment must stay equal to this)."""
    dropped = ("XLA_FLAGS", "WUS_FAULT", "PYTEST_CURRENT_TEST")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "PYTHONPATH": REPO, **variables}


_SERVER: forked.Server | None = None
_SERVER_LOCK = threading.Lock()


@pytest.fixture(scope="session", autouse=True)
def _command_server():
    """Ends this process's command server (tests/forked.py) with the session."""
    yield
    if _SERVER is not None:
        _SERVER.close()


def run_command(
    command: list[str],
    *,
    timeout: float = 300,
    stdin: str | None = None,
    fresh: bool = False,
    **variables: str,
) -> subprocess.CompletedProcess:
    """Runs ``command`` to the end from :data:`REPO` in :func:`command_env`
    (``variables`` set), ``stdin`` as its input; its output captured as text.

    A ``python -m`` command with neither an input nor variables of its own runs as a
    fork of this process's command server (tests/forked.py: the same command without
    3 s of imports), unless ``fresh``; any other as a fresh process."""
    global _SERVER
    env = command_env(**variables)
    if not fresh and stdin is None and command[:2] == [sys.executable, "-m"]:
        with _SERVER_LOCK:
            if _SERVER is None:
                _SERVER = forked.Server(REPO, command_env())
        if env == _SERVER.env:  # a test may have changed this process's environment
            return _SERVER.run(command, timeout)
    return subprocess.run(
        command,
        cwd=REPO,
        env=env,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_command(command: list[str], **variables: str) -> subprocess.Popen:
    """Starts ``command`` from :data:`REPO` in :func:`command_env` (``variables`` set), its
    stdout and stderr merged into one text pipe for the test to read as the run goes."""
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=command_env(**variables),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


# The 1+1-layer Transformer of the model and step tests (TransformerConfig fields).
TINY_TRANSFORMER = {
    "vocab_size": 64,
    "emb_dim": 32,
    "num_heads": 2,
    "qkv_dim": 32,
    "mlp_dim": 64,
    "num_encoder_layers": 1,
    "num_decoder_layers": 1,
}


def tiny_wus(mode="wus", opt="adam", *, mesh="data8", dtype="float32", accumulate=1):
    """A 1+1-layer Transformer on random tokens for exact step comparisons: ``mesh`` is
    data8, data4_model2, group2 (shard_group_size 2), devices6, buckets (data8, every
    sharded parameter gathered in shared all-gathers) or scanned (data8, 2+2 layers
    in layer stacks)."""
    config = transformer_1024.get_config("tiny,synthetic")
    # One module per layer, but in the "scanned" case (the trainer's default stacks).
    config.model.update(**TINY_TRANSFORMER, dtype=dtype, scan_layers=False)
    config.data.update(vocab_size=64, max_length=8)
    config.global_batch_size = 16
    config.num_train_steps = 100
    config.optimizer.update(
        name=opt,
        update_sharding=mode,
        min_shard_bytes=0,
        clip_norm=0.5,
        warmup_steps=2,
        learning_rate=0.01,
        weight_decay=0.01,
        schedule="constant",
        accumulate_steps=accumulate,
    )
    if mesh == "data4_model2":
        config.mesh.axes.update(data=4, model=2)
    elif mesh == "group2":
        config.optimizer.shard_group_size = 2
    elif mesh == "devices6":
        config.mesh.num_devices = 6
        config.global_batch_size = 12
    elif mesh == "buckets":
        config.optimizer.gather_bucket_bytes = 1 << 20
    elif mesh == "scanned":
        config.model.update(num_encoder_layers=2, num_decoder_layers=2, scan_layers=True)
    return config


def data_section(name: str, data_dir, /, **keys) -> ml_collections.ConfigDict:
    """A pipeline's ``data`` config section: the keys every pipeline shares (reading
    in this process, no grain workers) for dataset ``name``, then its own ``keys``."""
    config = {
        "name": name,
        "data_dir": str(data_dir),
        "train_split": "train",
        "worker_count": 0,
        "worker_buffer_size": 2,
    }
    config.update(keys)
    return ml_collections.ConfigDict(config)


def open_pipeline(make, config, global_batch_size, seed=0, process_index=0, process_count=1):
    """``make(config, opts)`` for process ``process_index`` of ``process_count``, the way
    ``trainer.input.pipelines.build`` opens a run's data."""
    opts = DataOptions.from_config(
        config,
        global_batch_size=global_batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    return make(config, opts)


def set_compilation_cache(enabled: bool) -> bool:
    """Turns JAX's persistent compilation cache on or off in this test process; returns
    what it was. A cache hit dumps no HLO, and compiles for a TPU topology (no client)
    cannot read an entry: tests of either compile without it."""
    import jax  # noqa: PLC0415
    from jax.experimental.compilation_cache import compilation_cache  # noqa: PLC0415

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()  # JAX decides once whether it uses the cache: ask again
    return was


@pytest.fixture
def without_compilation_cache():
    """The test compiles without the suite's persistent cache."""
    was = set_compilation_cache(False)
    yield
    set_compilation_cache(was)


def tpu_devices(topology: str, *, num_slices: int = 1) -> list:
    """libtpu's devices of ``topology``; skips the test where libtpu is not installed
    (the ``[tpu]`` extra), and fails on any other error (a wrong topology name)."""
    from trainer.analysis import compiled as compiled_lib  # noqa: PLC0415  (imports JAX)
    from trainer.errors import ConfigError  # noqa: PLC0415

    try:
        return compiled_lib.topology_devices(topology, num_slices=num_slices)
    except ConfigError as e:
        if "needs libtpu" in str(e):
            pytest.skip(f"libtpu cannot load here (pip install -e '.[tpu]'): {e}")
        raise
