"""``python -m trainer.export --workdir DIR [--step S] --out PATH [--dtype bfloat16]
[--format orbax|hf] [--scan_layers true|false]``.

Writes only the model parameters of a training checkpoint (or of the Hugging Face
model directory ``--workdir`` names). ``--format orbax`` (the default): in their
logical shapes, as a plain Orbax checkpoint
(:mod:`trainer.inference.export`); another run starts from them with
``--config.init_from=PATH`` (a run with the other ``model.scan_layers`` too:
init_from converts), and ``--scan_layers`` writes a Transformer's layers stacked or
one module per layer, whichever way it trained. ``--format hf``: a decoder run as a
Hugging Face model directory that ``transformers`` loads
(:mod:`trainer.inference.hf_export`).

What can be refused is refused before anything is written, and the files are
written into a temporary directory renamed ``--out`` at the end: a failed export (a
full disk, Ctrl-C) leaves nothing at ``--out``, and ``--out`` may not lie in the
run's ``checkpoints/``.

Example:
python -m trainer.export --workdir /tmp/demo --out /tmp/demo_params --dtype bfloat16
python -m trainer.export --workdir /tmp/mylm --format hf --out /tmp/mylm_hf --dtype bfloat16
"""

from __future__ import annotations

from absl import flags

from trainer import console
from trainer.command import cli, process
from trainer.errors import UserError

_WORKDIR = flags.DEFINE_string(
    "workdir", None, "Run directory with checkpoints/, or a Hugging Face model directory."
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the exported parameters to.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Exported dtype.")
_FORMAT = flags.DEFINE_enum(
    "format",
    "orbax",
    ["orbax", "hf"],
    "orbax: a plain Orbax checkpoint of the parameters; hf: a Hugging Face model "
    "directory (config.json, safetensors, tokenizer files) of a decoder run.",
)
_SCAN_LAYERS = flags.DEFINE_enum(
    "scan_layers",
    "as_trained",
    ["as_trained", "true", "false"],
    "Write a Transformer's layers as stacks [layers, ...] (true) or one module per layer "
    "(false), whichever way the run trained.",
)
flags.mark_flags_as_required(["workdir", "out"])


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    process.setup()
    from trainer.inference import export  # noqa: PLC0415  (imports JAX, Orbax)

    if _FORMAT.value == "hf":
        _export_hf()
        return
    with cli.clear_errors():
        scan = {"as_trained": None, "true": True, "false": False}[_SCAN_LAYERS.value]
        with console.phase(f"exporting the parameters of {_WORKDIR.value} to {_OUT.value}"):
            step, _ = export.export(
                _WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value, scan_layers=scan
            )
    source = f"step {step}" if step is not None else _WORKDIR.value
    print(f"exported the {_DTYPE.value} params of {source} to {_OUT.value}")


def _export_hf() -> None:
    from trainer.inference import hf_export  # noqa: PLC0415  (imports JAX, TensorStore)

    with cli.clear_errors():
        if _SCAN_LAYERS.value != "as_trained":
            raise UserError("--scan_layers is for --format orbax (Hugging Face has one layout)")
        with console.phase(f"writing {_WORKDIR.value} as a Hugging Face model to {_OUT.value}"):
            done = hf_export.export(
                _WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value
            )
    source = f"step {done.step}" if done.step is not None else _WORKDIR.value
    print(
        f"exported {source} as {done.architecture} to {_OUT.value}: "
        f"{done.total_bytes / 2**20:,.1f} MiB of {_DTYPE.value} weights in {done.shards} "
        f"safetensors shard(s), largest tensor {done.largest_bytes / 2**20:,.1f} MiB"
    )


if __name__ == "__main__":
    process.run(main)
