"""``python -m trainer.data.prepare --config C [--eval_text FILE] [--out DIR]``: input, ahead.

Generates an embedded dataset if missing and opens the run's pipeline once, which
trains the SentencePiece vocabulary and caches the token lengths of a translation
dataset or of a language model's documents (so that the processes of a pod run find
them ready). The embedded datasets' builders are in trainer/input/builders/. For a
translation config, ``--eval_text FILE`` also writes the eval split's source
sentences to FILE, one a line, and their reference translations to FILE.ref: input
for ``python -m trainer.translate`` and references to score its output against.

For a language model (configs/llama.py, configs/bert_large.py), ``--out DIR`` instead
tokenizes the training documents once into a token store at DIR, reading them a batch
at a time (corpora larger than memory; trainer/input/token_store.py), training the
SentencePiece model first if none is configured; a run then memory-maps the store:
``--config.data.tokenized_dir=DIR``.

Example:
python -m trainer.data.prepare --config configs/transformer_1024.py:tiny --eval_text val.txt
"""

import sys
import time

if __name__ == "__main__":
    try:  # a Ctrl-C while the modules below import (seconds): one line, code 130
        from trainer.command import signals

        signals.quiet_start()
    except KeyboardInterrupt:
        sys.exit(130)

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from trainer import console, tasks  # noqa: E402
from trainer.command import cli, process  # noqa: E402
from trainer.workdir import storage  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config: path[:variant].")
_EVAL_TEXT = flags.DEFINE_string(
    "eval_text", None, "Write the eval split's sources here and their references to <this>.ref."
)
_OUT = flags.DEFINE_string(
    "out", None, "Language models: tokenize the training documents into a token store here."
)
flags.mark_flags_as_required(["config"])


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    process.setup()
    config = _CONFIG.value
    config.data.worker_count = 0
    start = time.perf_counter()
    if _OUT.value:
        with cli.clear_errors():
            _write_store(config, _OUT.value)
        return
    with cli.clear_errors():
        if _EVAL_TEXT.value:  # before the work: a path mistake is found at once
            storage.output_file(_EVAL_TEXT.value, "--eval_text")
            storage.output_file(_EVAL_TEXT.value + ".ref", "--eval_text")
        data = tasks.open_data(config)
        if _EVAL_TEXT.value:
            if not hasattr(data, "eval_references"):
                cli.fail(f"--eval_text: {config.data.name} is not a translation dataset")
            sources, references = data.eval_references()
            storage.path(_EVAL_TEXT.value).write_text("".join(s + "\n" for s in sources))
            storage.path(_EVAL_TEXT.value + ".ref").write_text(
                "".join(r + "\n" for r in references)
            )
            console.say(f"wrote {len(sources)} sources to {_EVAL_TEXT.value} (references: .ref)")
    console.say(f"prepared the input of {config.data.name} in {time.perf_counter() - start:.0f}s")


def _write_store(config, out: str) -> None:
    """The token store of a language model's training documents at ``out``."""
    if config.model.name not in ("decoder", "bert"):
        cli.fail(f"--out: model.name={config.model.name!r} is not a language model's config")
    from trainer.input import pipelines  # noqa: PLC0415  (NumPy, SentencePiece)
    from trainer.input.language import pipeline as language  # noqa: PLC0415

    storage.make_directory(out, "--out")
    start = time.perf_counter()
    manifest = pipelines.open_pipeline(
        lambda data, opts: language.write_token_store(data, opts, out), config
    )
    console.say(
        f"wrote {manifest['documents']:,} documents, {manifest['tokens']:,} tokens "
        f"({manifest['dtype']}) to {out} in {time.perf_counter() - start:.0f}s; train on it "
        f"with --config.data.tokenized_dir={out}"
    )


if __name__ == "__main__":
    process.run(main)
