"""``python -m trainer.evaluate --workdir DIR [--step S] [--cpu_devices N] [--config.x=y ...]``.

Runs the run's evaluation (the one training runs every ``eval_every_steps``: eval
loss and accuracy, BLEU, HR@10, ...) on one checkpoint of ``DIR`` (the newest by
default), on whatever devices and mesh this process has, prints one line and
appends ``{"step": S, "eval/...": ..., "overrides": {...}}`` to ``DIR/eval.jsonl``.
The config is the run's (``DIR/config.json``); ``--config.x=y`` overrides it as
for the trainer, e.g. ``--config.eval_beam_size=4`` or ``--config.mesh.axes.model=2``.
Only the parameters (and model state) are read, not the optimizer state. The
metrics also go to TensorBoard, as the run ``evaluate`` inside DIR.

``--workdir`` may name a Hugging Face model directory instead (a Llama, Mistral or
Qwen2 saved by ``transformers``, or ``trainer.export --format hf``'s): its config is
``configs/llama.py:hf=DIR`` and ``--config.data.eval_files=FILES`` names the documents
to evaluate it on. Its result is printed only: a model directory is not a run's, and
gets no ``eval.jsonl``.

Example:
python -m trainer.evaluate --workdir /tmp/demo --config.eval_beam_size=4
"""

from __future__ import annotations

import sys

from absl import flags

from trainer import console
from trainer.command import cli, process, run_flags
from trainer.errors import UserError
from trainer.hf import config as hf_config
from trainer.workdir import storage

_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory (python -m trainer's --workdir), or a Hugging Face model directory.",
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Expose this many CPU devices.")


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    # stdout is the result line's; what it is doing goes to stderr.
    process.setup(cpu_devices=_CPU_DEVICES.value, console_stream=sys.stderr, writes_events=True)
    import jax  # noqa: PLC0415  (after setup)

    from trainer.training import evaluation  # noqa: PLC0415  (imports JAX, Flax, Orbax)

    config = run_flags.config_value()
    with cli.clear_errors():
        if hf_config.is_model_directory(_WORKDIR.value):
            _evaluate_hugging_face(config)
            return
        step, result = evaluation.evaluate_checkpoint(config, _WORKDIR.value, step=_STEP.value)
    metrics = result.metrics
    for sample in result.samples:
        console.say(f"  sample: {sample}")
    if jax.process_index() == 0:
        # The result first: recording it may fail (a read-only run directory).
        print(" | ".join([f"step {step}", *(f"{k} {v:.4g}" for k, v in metrics.items())]))
        sys.stdout.flush()
        overrides = run_flags.overrides(_WORKDIR.value, config)
        directory = storage.path(_WORKDIR.value)
        try:
            evaluation.record_result(_WORKDIR.value, step, metrics, overrides)
        except OSError as e:
            console.warn(
                f"could not record the result in {directory / 'eval.jsonl'} "
                f"({storage.explain(e)}); it is only in the line above"
            )
        try:
            evaluation.record_events(_WORKDIR.value, step, metrics)
        except OSError as e:
            events = directory / evaluation.EVENTS_SUBDIR
            console.warn(
                f"could not write the TensorBoard events into {events} ({storage.explain(e)}); "
                "the result is in eval.jsonl and the line above"
            )


def _evaluate_hugging_face(config) -> None:
    """Evaluates the Hugging Face model ``--workdir`` names on ``data.eval_files`` and
    prints the result (the module docstring)."""
    from trainer.inference import loading  # noqa: PLC0415  (imports JAX, Flax, Orbax)
    from trainer.training import evaluation  # noqa: PLC0415
    from trainer.training import experiment as experiment_lib  # noqa: PLC0415

    workdir = _WORKDIR.value
    if _STEP.value is not None:
        raise UserError(f"--step: {workdir} is a Hugging Face model, of one step")
    if not config.data.eval_files:
        raise UserError(
            f"--workdir {workdir} is a Hugging Face model: name the documents to evaluate it "
            "on, --config.data.eval_files=FILES (globs of .txt, .jsonl or .parquet)"
        )
    model = experiment_lib.build_model(config)
    with console.phase(f"reading the parameters of {workdir}"):
        params = loading.hugging_face_params(model, storage.path(workdir))
    result = evaluation.make_evaluator(model)({"params": params})
    for sample in result.samples:  # as for a run's checkpoint (main)
        console.say(f"  sample: {sample}")
    print(" | ".join([workdir, *(f"{k} {v:.4g}" for k, v in result.metrics.items())]))
    sys.stdout.flush()
    console.say(f"(not recorded: {workdir} is a model directory, not a run's work directory)")


if __name__ == "__main__":
    process.run(main, flags_parser=run_flags.parse_flags)
