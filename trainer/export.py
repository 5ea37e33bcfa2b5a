"""``python -m trainer.export --workdir DIR [--step S] --out PATH [--dtype bfloat16]
[--scan_layers true|false]``.

Writes only the model parameters of a training checkpoint, in their logical
shapes, as a plain Orbax checkpoint (:mod:`trainer.inference.export`). Another
run starts from them with ``--config.init_from=PATH`` (a run with the other
``model.scan_layers`` too: init_from converts). ``--scan_layers`` writes a
Transformer's layers stacked or one module per layer, whichever way it trained.

Example:
python -m trainer.export --workdir /tmp/demo --out /tmp/demo_params --dtype bfloat16
"""

from __future__ import annotations

from absl import flags

from trainer import console
from trainer.command import cli, process

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory with checkpoints/.")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")
_OUT = flags.DEFINE_string("out", None, "Directory to write the exported parameters to.")
_DTYPE = flags.DEFINE_enum("dtype", "float32", ["float32", "bfloat16"], "Exported dtype.")
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

    with cli.clear_errors():
        scan = {"as_trained": None, "true": True, "false": False}[_SCAN_LAYERS.value]
        with console.phase(f"exporting the parameters of {_WORKDIR.value} to {_OUT.value}"):
            step, _ = export.export(
                _WORKDIR.value, _OUT.value, step=_STEP.value, dtype=_DTYPE.value, scan_layers=scan
            )
    print(f"exported the {_DTYPE.value} params of step {step} to {_OUT.value}")


if __name__ == "__main__":
    process.run(main)
