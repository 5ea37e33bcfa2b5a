"""``python -m trainer.plot DIR [DIR ...] --out FILE.png [--names a,b]``.

One figure of the runs in the given directories, overlaid and named: training
loss and every eval metric against steps (:func:`trainer.analysis.figures.plot_runs`).
Needs matplotlib (``pip install -e '.[plot]'``).

Example:
python -m trainer.plot /tmp/demo --out /tmp/demo/metrics.png
"""

from __future__ import annotations

import sys

from absl import flags

from trainer.analysis import figures
from trainer.command import cli, process
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
    print(f"wrote {out}: {', '.join(metrics)} of {len(workdirs)} run(s)", file=sys.stderr)


if __name__ == "__main__":
    process.run(main)
