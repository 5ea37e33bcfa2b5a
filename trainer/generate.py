"""``python -m trainer.generate --workdir DIR [--step S] [--max_new_tokens N] [--temperature T]
[--top_k K] [--top_p P] [--seed S] [--batch_size B] [--chat] [--cpu_devices N] < prompts.txt``.

One prompt a line in, its continuation a line out (an empty prompt is continued from
BOS alone; a newline the model writes becomes a space and a line that is not UTF-8
gets an empty continuation and a warning, so that the output keeps one line per
input line), with a language-model run's tokenizer and the parameters of one
checkpoint (the newest by default; the optimizer state is not read), or of an export
or a Hugging Face model directory (``--workdir`` names it). Greedy by default
(``--temperature 0``); a positive temperature samples, ``--top_k`` and ``--top_p``
narrow the choice, and ``--seed`` makes the samples repeatable. A row ends at the
tokenizer's EOS (any of the model's, where its ``generation_config.json`` lists
several). Every flag is checked before the prompts are read. A summary (step,
compile time, tokens/s) goes to stderr.

``--chat``: each line is a conversation to answer, a user's message as plain text or a
JSON list of ``{"role", "content"}`` messages, rendered with the model's chat template
(``Generator.generate(..., chat=True)``); the answer ends at the template's end of turn.

Example:
python -m trainer.generate --workdir /tmp/lm --max_new_tokens 24 < prompts.txt
python -m trainer.generate --workdir /tmp/sft --chat < questions.txt
"""

from __future__ import annotations

import json
import sys

from absl import flags

from trainer import console
from trainer.command import cli, process, run_flags

_MAX_LINE_WARNINGS = 10  # then a count

_WORKDIR = flags.DEFINE_string(
    "workdir",
    None,
    "Run directory (python -m trainer's --workdir), an export, or a Hugging Face model directory.",
)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 64, "Tokens to generate per prompt.")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; else sample at it.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample from the k most likely tokens (0: all).")
_TOP_P = flags.DEFINE_float(
    "top_p", 1.0, "Sample from the most likely tokens whose probabilities reach p (1: all)."
)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the samples (the same seed: the same samples).")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 16, "Prompts generated together (rounded up to a multiple of the devices)."
)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Expose this many CPU devices.")
_CHAT = flags.DEFINE_bool(
    "chat", False, "Each line is a conversation (a message, or a JSON list of messages)."
)


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    # stdout is the continuations'; what it is doing goes to stderr.
    process.setup(cpu_devices=_CPU_DEVICES.value, console_stream=sys.stderr)
    console.say(f"generating with {_WORKDIR.value}")
    from trainer.inference import generator, loading, translator  # noqa: PLC0415  (JAX, Flax)

    config = run_flags.config_value()
    if sys.stdin is None:
        cli.fail("stdin is closed: give the prompts on it, one a line (... < prompts.txt)")
    settings = dict(
        max_new_tokens=_MAX_NEW_TOKENS.value,
        temperature=_TEMPERATURE.value,
        top_k=_TOP_K.value,
        top_p=_TOP_P.value,
        seed=_SEED.value,
        batch_size=_BATCH_SIZE.value,
    )
    # Before stdin is read and the model loaded: a wrong --workdir or flag fails at once.
    with cli.clear_errors():
        loading.require_family(config, "decoder")
        generator.check_arguments(config.model, **settings)
    lines, unreadable = translator.read_lines(sys.stdin.buffer.read())
    readable = [i for i, line in enumerate(lines) if line is not None]
    with cli.clear_errors():
        model = generator.Generator.load(_WORKDIR.value, step=_STEP.value, config=config)
        prompts = [lines[i] for i in readable]
        if _CHAT.value:
            prompts = [_conversation(i, lines[i]) for i in readable]
        continued, report = model.generate_with_report(prompts, chat=_CHAT.value, **settings)
    out = [""] * len(lines)
    for i, text in zip(readable, continued, strict=True):
        out[i] = " ".join(text.splitlines())
    sys.stdout.write("".join(line + "\n" for line in out))
    sys.stdout.flush()
    for i, why in unreadable[:_MAX_LINE_WARNINGS]:
        console.warn(f"input line {i + 1} {why}: its continuation is left empty")
    if len(unreadable) > _MAX_LINE_WARNINGS:
        console.warn(f"{len(unreadable) - _MAX_LINE_WARNINGS} more input lines left empty")
    how = "greedy" if _TEMPERATURE.value <= 0 else f"sampled at temperature {_TEMPERATURE.value:g}"
    source = f"checkpoint {report.step} of" if report.step is not None else "the parameters of"
    print(
        f"generated {_count(report.tokens, 'token')} for "
        f"{_count(report.prompts, 'prompt')} with {source} {_WORKDIR.value}, {how}: "
        f"{report.generate_s:.2f}s ({report.tokens_per_sec:.1f} tokens/s) after "
        f"{report.compile_s:.1f}s of compiling",
        file=sys.stderr,
    )


def _conversation(index: int, line: str):
    """A line of ``--chat`` input: a JSON list of messages, or a user's message."""
    if line.lstrip().startswith("["):
        try:
            return json.loads(line)
        except ValueError as e:
            cli.fail(f"input line {index + 1} is not a JSON list of messages ({e})")
    return line


def _count(n: int, noun: str) -> str:
    """``1 prompt``, ``2 prompts``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


if __name__ == "__main__":
    process.run(main, flags_parser=run_flags.parse_flags)
