"""``python -m trainer.translate --workdir DIR [--step S] [--beam_size K] [--max_length N]
[--cpu_devices N] [--config.x=y ...] < sentences.txt > translations.txt``.

One source sentence a line in, its translation a line out (empty lines stay
empty), with the run's own tokenizer and the parameters of one checkpoint (the
newest by default; the optimizer state is not read). ``--beam_size 1`` decodes
greedily; larger beams use beam search with the run's ``length_penalty``
(``--config.length_penalty=`` to change it). Sources longer than the run's
``data.max_length`` tokens are cut there, as in evaluation. A summary (step,
compile time, sentences per second) goes to stderr.

Sentences are sorted by length and decoded ``--batch_size`` at a time, split over
the data-parallel devices, their length padded to a power of two (one compiled
program per length). Progress goes to stderr.

Sentences to try it on: the run's eval split, one source a line, written by
python -m trainer.data.prepare --config configs/transformer_1024.py:tiny --eval_text sentences.txt

Example:
python -m trainer.translate --workdir /tmp/demo --beam_size 4 < sentences.txt > out.txt
"""

from __future__ import annotations

import sys

from absl import flags

from trainer import console
from trainer.command import cli, process, run_flags

_MAX_LINE_WARNINGS = 10  # then a count

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (python -m trainer's --workdir).")
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_BEAM_SIZE = flags.DEFINE_integer(
    "beam_size", None, "Beam size; 1 = greedy (default: the run's eval_beam_size)."
)
_MAX_LENGTH = flags.DEFINE_integer(
    "max_length", None, "Tokens per translation at most (default: the run's max_decode_length)."
)
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 64, "Sentences decoded together (rounded up to a multiple of the devices)."
)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Expose this many CPU devices.")


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    # stdout is the translations'; what it is doing goes to stderr.
    process.setup(cpu_devices=_CPU_DEVICES.value, console_stream=sys.stderr)
    from trainer.inference import translator  # noqa: PLC0415  (imports JAX, Flax, Orbax)

    config = run_flags.config_value()
    if sys.stdin is None:
        cli.fail("stdin is closed: give the sentences on it, one a line (... < sentences.txt)")
    with cli.clear_errors():  # before stdin is read: a wrong --workdir fails at once
        translator.require_translation_run(config)
    beam = config.eval_beam_size if _BEAM_SIZE.value is None else _BEAM_SIZE.value
    lines, unreadable = translator.read_lines(sys.stdin.buffer.read())
    with cli.clear_errors():
        model = translator.Translator.load(_WORKDIR.value, step=_STEP.value, config=config)
        out, report = model.translate_with_report(
            [line or "" for line in lines],
            beam_size=beam,
            max_length=_MAX_LENGTH.value,
            batch_size=_BATCH_SIZE.value,
        )
    sys.stdout.write("".join(line + "\n" for line in out))
    sys.stdout.flush()
    problems = sorted([*unreadable, *report.skipped])
    for i, why in problems[:_MAX_LINE_WARNINGS]:
        console.warn(f"input line {i + 1} {why}: its translation is left empty")
    if len(problems) > _MAX_LINE_WARNINGS:
        console.warn(f"{len(problems) - _MAX_LINE_WARNINGS} more input lines left empty")
    rate = report.sentences / max(report.decode_s, 1e-9)
    print(
        f"translated {report.sentences} sentences with checkpoint {report.step} of "
        f"{_WORKDIR.value}, beam {beam}: {report.decode_s:.2f}s ({rate:.1f} sentences/s) after "
        f"{report.compile_s:.1f}s of compiling"
        + (
            f"; {report.truncated} sources cut at {config.data.max_length} tokens"
            if report.truncated
            else ""
        ),
        file=sys.stderr,
    )


if __name__ == "__main__":
    process.run(main, flags_parser=run_flags.parse_flags)
