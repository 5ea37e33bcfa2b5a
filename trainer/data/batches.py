"""``python -m trainer.data.batches --workdir DIR --steps A:B [--out FILE.npz] [--decode]``.

The training batches that steps A to B (1-based, both included) of the run in DIR
consumed, rebuilt by the run's own input pipeline from its recorded config
(``DIR/config.json``, the last leg's) and the tokenizer it kept in DIR: step ``s``
reads global batch ``s - 1``, the same rows whichever number of processes, devices or
grain workers trained it. Every field of the batch is given: a decoder's ``inputs``,
``targets``, ``segmentation`` (the document of each token in a packed row, 0 for
padding), ``positions`` (within its document) and ``weights`` (1 where the token is a
target of the loss); BERT's masked inputs with ``masked_positions``, ``masked_ids``
and ``masked_weights``; a translation's or a recommender's features.

Printed as one JSON line a row, ``{"step": s, "row": r, "<field>": [...], ...}``
(with ``--decode`` a language model's rows also as ``"text"``), or written with
``--out`` as one ``.npz``: each field an array ``[steps, global_batch, ...]`` and
``steps`` the step numbers. For a loss spike at step 1234:

    python -m trainer.data.batches --workdir /tmp/lm --steps 1234:1234 --decode
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from absl import flags

from trainer.command import cli, process, run_flags
from trainer.workdir import storage

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory (python -m trainer's --workdir).")
_STEPS = flags.DEFINE_string("steps", None, "Steps A:B (1-based, both included), or one step.")
_OUT = flags.DEFINE_string("out", None, "Write the batches to this .npz instead of printing.")
_DECODE = flags.DEFINE_bool("decode", False, "Also print each row's text (language models).")


def step_range(text: str) -> tuple[int, int]:
    """``"A:B"`` or ``"A"`` -> ``(A, B)``, 1 <= A <= B.

    Raises:
      UserError: anything else.
    """
    first, _, last = text.partition(":")
    try:
        a, b = int(first), int(last or first)
    except ValueError:
        cli.fail(f"--steps={text!r}: expected A:B, two step numbers (or one)")
    if not 1 <= a <= b:
        cli.fail(f"--steps={text!r}: steps count from 1, and A:B needs A <= B")
    return a, b


def run_tokenizer_config(config, workdir: str):
    """``config`` reading the tokenizer the run kept in ``workdir`` where it trained
    its own (``data.tokenizer`` empty): the run's vocabulary, even where the corpus
    or the data directory it was trained from has changed."""
    from trainer import tasks  # noqa: PLC0415  (imports the input pipelines)

    if "tokenizer" not in config.data or config.data.tokenizer:
        return config
    directory = storage.path(workdir)
    kept = [n for n in tasks.run_file_names(config) if (directory / n).exists()]
    if kept:
        config.data.tokenizer = str(directory / kept[0])
    return config


def read_batches(config, first: int, last: int) -> tuple[dict[str, np.ndarray], Any]:
    """Every field of the global batches of steps ``first`` .. ``last``, stacked
    ``[steps, global_batch, ...]``, and the opened input pipeline (its tokenizer)."""
    from trainer import tasks  # noqa: PLC0415

    config.data.worker_count = 0
    data = tasks.open_data(config)  # as process 0 of 1: whole global batches
    data.train.set_state({"global_batch": first - 1})
    batches = [next(data.train) for _ in range(first, last + 1)]
    data.train.close()
    return {key: np.stack([b[key] for b in batches]) for key in batches[0]}, data


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    process.setup(console_stream=sys.stderr)  # stdout is the batches'; what it does, stderr
    first, last = step_range(_STEPS.value or cli.fail("--steps is required (A:B)"))
    with cli.clear_errors():
        config = run_tokenizer_config(run_flags.config_value(), _WORKDIR.value)
        if _OUT.value:
            storage.output_file(_OUT.value, "--out")
        fields, data = read_batches(config, first, last)
    steps = np.arange(first, last + 1)
    if _OUT.value:
        with storage.path(_OUT.value).open("wb") as f:
            np.savez(f, steps=steps, **fields)
        print(f"wrote steps {first}..{last} ({', '.join(sorted(fields))}) to {_OUT.value}")
        return
    tokenizer = getattr(data, "tokenizer", None)
    if _DECODE.value and tokenizer is None:
        cli.fail(f"--decode: {config.model.name} has no text tokenizer")
    for i, step in enumerate(steps.tolist()):
        for row in range(len(next(iter(fields.values()))[i])):
            line = {"step": step, "row": row}
            line |= {key: value[i, row].tolist() for key, value in fields.items()}
            if _DECODE.value:
                line["text"] = _text(tokenizer, fields, i, row)
            sys.stdout.write(json.dumps(line) + "\n")


def _text(tokenizer, fields, i: int, row: int) -> list[str]:
    """The documents of one row, decoded (padding left out)."""
    ids, segments = fields["inputs"][i, row], fields["segmentation"][i, row]
    return [
        tokenizer.decode(ids[segments == s].tolist()) for s in np.unique(segments[segments > 0])
    ]


if __name__ == "__main__":
    process.run(main, flags_parser=run_flags.parse_flags)
