"""``python -m trainer.plot DIR [DIR ...] --out FILE.png [--names a,b]``.

One figure of the runs in the given directories, overlaid and named: training
loss and every eval metric against steps (:func:`trainer.analysis.figures.plot_runs`).
Needs matplotlib (``pip install -e '.[plot]'``).

A loss, NLL or perplexity is per token of a run's tokenizer: language-model runs
that kept different tokenizers are drawn, with a warning naming them, as their
curves do not compare.

Example:
python -m trainer.plot /tmp/demo --out /tmp/demo/metrics.png
"""

from __future__ import annotations

import hashlib
import sys

from absl import flags

from trainer import console
from trainer.analysis import figures
from trainer.command import cli, process
from trainer.input import tokenizer as tokenizer_lib
from trainer.workdir import storage

_OUT = flags.DEFINE_string("out", None, "PNG file to write.")
_NAMES = flags.DEFINE_list("names", [], "Run names for the legend (default: directory names).")


def main(argv: list[str]) -> None:
    workdirs, out = argv[1:], _OUT.value
    if not workdirs:
        cli.fail("name at least one run directory: python -m trainer.plot DIR [DIR ...] --out F")
    if not out:
        cli.fail("--out FILE.png is required")
    process.setup()
    with cli.clear_errors():
        storage.output_file(out, "--out")
    names = _NAMES.value or None
    if names and len(names) != len(workdirs):
        cli.fail(f"--names has {len(names)} names for {len(workdirs)} run directories")
    missing = [w for w in workdirs if not (storage.path(w) / "metrics.jsonl").exists()]
    if missing:
        cli.fail(f"no metrics.jsonl in {', '.join(missing)}")
    with cli.clear_errors():
        metrics = figures.plot_runs(workdirs, out, names)
    _warn_of_tokenizers(workdirs)
    print(f"wrote {out}: {', '.join(metrics)} of {len(workdirs)} run(s)", file=sys.stderr)


def _warn_of_tokenizers(workdirs: list[str]) -> None:
    """Warns if the runs kept different tokenizers: their per-token losses differ in unit."""
    kept = {}
    for workdir in workdirs:
        files = [
            storage.path(workdir) / name
            for name in (tokenizer_lib.SPM_FILE, tokenizer_lib.HF_FILES[0])
        ]
        digests = [hashlib.sha256(f.read_bytes()).hexdigest()[:8] for f in files if f.exists()]
        if digests:
            kept[workdir] = "+".join(digests)
    if len(set(kept.values())) > 1:
        which = ", ".join(f"{w} ({d})" for w, d in kept.items())
        console.warn(
            f"the runs tokenize differently: {which}: their loss, eval/nll and eval/perplexity "
            "are per token of different tokenizers and do not compare"
        )


if __name__ == "__main__":
    process.run(main)
