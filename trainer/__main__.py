"""``python -m trainer --config FILE.py[:VARIANT] --workdir DIR [--config.KEY=VALUE ...]``.

Trains the config's model in DIR: metrics.jsonl, TensorBoard events, checkpoints
and, at the end, summary.json. Run it again with the same DIR to resume from the
newest checkpoint. ``--config.a.b=value`` overrides one key of the config,
``python -m trainer --list_configs`` lists the configs and their variants, and
``--print_config`` prints every key of a config with what it does.

SIGTERM and Ctrl-C save and stop the run (exit 0 after SIGTERM, 130 after
Ctrl-C); Ctrl-C twice stops at once. Mistakes in the input end in one line on
stderr and a non-zero exit.

Example:
python -m trainer --config configs/transformer_1024.py:tiny --workdir /tmp/demo --cpu_devices 8
"""

from __future__ import annotations

import sys
import time

_STARTED = time.time()  # the summary's start-up time counts from here

if __name__ == "__main__":
    try:  # a Ctrl-C in the instant before the handling is in place
        from trainer.command import signals

        signals.install()  # before the slow imports below: no stop request is lost
    except KeyboardInterrupt:
        sys.exit(130)

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from trainer import console  # noqa: E402
from trainer.command import cli, process, signals  # noqa: E402
from trainer.workdir import run_config, storage  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config: path[:variant].")
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Directory for metrics and checkpoints (required, but with --print_config)."
)
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", 0, "Expose this many CPU devices (CPU-only hosts; for trying sharding)."
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "host:port of process 0, for multi-process runs that no "
    "scheduler describes (TPU pods and SLURM are detected automatically).",
)
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
flags.DEFINE_bool("list_configs", False, "List the configs, their variants and exit.")
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config",
    False,
    "Print every key of --config with its value, the file's default and what it does, and exit.",
)
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout",
    60,
    "Seconds after which a process of the job that stopped answering (frozen, or its host "
    "gone) is taken for lost: the others stop in one line. JAX's own timeout is twice this.",
)
_ACCEPT_NEW_TOKENIZER = flags.DEFINE_bool(
    "accept_new_tokenizer",
    False,
    "Resume a run with another tokenizer than the one it was trained with (refused "
    "otherwise: the checkpoint's embedding rows stand for its ids); the old one is kept.",
)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    if _PRINT_CONFIG.value:
        from trainer.command import config_docs  # noqa: PLC0415

        (source,) = cli.config_files(sys.argv)[-1:]
        defaults = run_config.flat_config(cli.load_config(source.partition(":")[0]))
        sys.stdout.write(config_docs.render(_CONFIG.value, defaults, source))
        return
    if _WORKDIR.value is None:
        cli.fail("flag --workdir must have a value: the run's directory")
    process.setup(
        cpu_devices=_CPU_DEVICES.value,
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value,
        process_id=_PROCESS_ID.value,
        heartbeat_timeout_s=_HEARTBEAT.value,
        writes_events=True,
    )
    config = _CONFIG.value
    (source,) = cli.config_files(sys.argv)[-1:]
    console.say(f"workdir {_WORKDIR.value}")
    console.say(cli.describe_config(config, source))

    import jax  # noqa: PLC0415  (after setup, like everything that uses devices)

    from trainer.training import train  # noqa: PLC0415  (imports JAX, Flax, Orbax: seconds)

    with cli.clear_errors():
        directory = storage.workdir(_WORKDIR.value)
        cache = process.use_compilation_cache(config.compilation_cache_dir, directory)
        if cache is not None:
            console.say(f"compilation cache: {cache}")
        if config.optimizer.update_sharding == "auto":
            from trainer.analysis import compiled  # noqa: PLC0415  (only when asked: compiles)

            config, _, _ = compiled.choose_update_sharding(config, jax.devices(), console.say)
        train.train(
            config,
            _WORKDIR.value,
            stop=signals.install(),
            started=_STARTED,
            accept_new_tokenizer=_ACCEPT_NEW_TOKENIZER.value,
            after_compile=process.release_freed_memory,
        )
    if signals.install().first == "SIGINT":
        sys.exit(signals.EXIT_INTERRUPTED)


if __name__ == "__main__":
    if any(arg in cli.LIST_CONFIGS for arg in sys.argv[1:]):
        sys.stdout.write(cli.list_configs())
        sys.exit(0)
    process.run(main)
