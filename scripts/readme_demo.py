"""Runs the README's demo, the tutorial of docs/running.md and the first language-model
run of docs/language_models.md, then rewrites what those pages show of them from those
very runs: the demo's console transcript (in the README), ``docs/tiny_run.png``, and
the language model's console (its held-out split, tokens/s and samples) in
docs/language_models.md.

    python scripts/readme_demo.py [--check]

The commands are the README's, with its paths (``/tmp/demo``, ``/tmp/demo_params``,
``/tmp/finetune``, ``/tmp/profiled``; removed first, so run it where nothing else
uses them). The embedded ``tiny_translation`` data and its vocabulary, and the
vocabularies trained on text files (``text_files_*_spm_*``: the language model's), are
removed from TFDS's default directory first too (the runs make them again in seconds),
so the transcript is a first run's, as a new user sees it. Each command's wall time
is printed. Each transcript replaces the block
between its page's ``readme_demo.py: transcript`` markers, and the picture is the
tutorial's own ``trainer.plot`` output, copied to ``docs/tiny_run.png``. ``--check``
changes nothing and exits 1 if a transcript has other metrics than this
run's (loss and eval figures, line by line; times and speeds are the machine's).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from trainer.input import text_files  # noqa: E402  (the name its vocabularies start with)

README = os.path.join(REPO, "README.md")
LANGUAGE_MODELS = os.path.join(REPO, "docs", "language_models.md")
PICTURE = os.path.join(REPO, "docs", "tiny_run.png")
BEGIN = "<!-- readme_demo.py: transcript -->"
END = "<!-- readme_demo.py: end -->"
TINY = "configs/transformer_1024.py:tiny"
DIRS = ("/tmp/demo", "/tmp/demo_params", "/tmp/finetune", "/tmp/profiled", "/tmp/mylm")
# docs/language_models.md's first run on text: the corpus in examples/text, shortened.
LM_DEMO = (
    "python -m trainer --config configs/llama.py:text --workdir /tmp/mylm --cpu_devices 8 "
    "--config.num_train_steps=200 --config.eval_every_steps=100"
)
# The tutorial of docs/running.md, after the demo run, as a user types it (shell redirections
# included); its outputs stay under /tmp/demo.
TUTORIAL = [
    "python -m trainer.evaluate --workdir /tmp/demo --cpu_devices 8 --config.eval_beam_size=4",
    f"python -m trainer.data.prepare --config {TINY} --eval_text /tmp/demo/sentences.txt",
    "python -m trainer.translate --workdir /tmp/demo --beam_size 4 --cpu_devices 8 "
    "< /tmp/demo/sentences.txt > /tmp/demo/translations.txt",
    "sacrebleu /tmp/demo/sentences.txt.ref -i /tmp/demo/translations.txt -b",
    "python -m trainer.export --workdir /tmp/demo --out /tmp/demo_params",
    f"python -m trainer --config {TINY} --workdir /tmp/finetune --cpu_devices 4 "
    "--config.init_from=/tmp/demo_params --config.optimizer.update_sharding=fsdp "
    "--config.optimizer.learning_rate=0.001 --config.num_train_steps=200",
    f"python -m trainer --config {TINY} --workdir /tmp/profiled --cpu_devices 8 "
    "--config.init_from=/tmp/demo_params --config.steps_per_loop=5 "
    "--config.profile_steps=10,5 --config.num_train_steps=20 --config.eval_every_steps=0",
    "python -m trainer.plot /tmp/demo /tmp/finetune --out /tmp/demo/run.png",
]
# What in a transcript line is the machine's, not the run's: times, speeds, the
# events file's name (its creation time).
_MACHINE = re.compile(
    r"\d+(\.\d+)?(m\d+)?s\b|\d+m\d+s|steps/s [\d.]+|[\d,]+ examples/s|ETA [^|]*$|"
    r"events\.out\.tfevents\.\d+\.\S+?(,|$)"
)


def run(command: str, *, capture: bool = False) -> str:
    """Runs ``command`` in a shell from the repository; says its wall time and, when
    ``capture``, the longest silence between the lines it printed (a pipe's view)."""
    print(f"$ {command}", flush=True)
    start = time.perf_counter()
    process = subprocess.Popen(
        command, shell=True, cwd=REPO, text=True, stdout=subprocess.PIPE if capture else None
    )
    lines, silence, last = [], (0.0, ""), start
    for line in process.stdout if capture else ():
        now = time.perf_counter()
        silence = max(silence, (now - last, line.strip()))
        lines.append(line)
        last = now
    code = process.wait()
    print(f"  ({time.perf_counter() - start:.1f}s)", flush=True)
    if capture:
        print(f"  longest silence: {silence[0]:.1f}s, before {silence[1][:60]!r}", flush=True)
    if code != 0:
        sys.exit(f"failed ({code}): {command}")
    return "".join(lines)


def transcript_block(text: str) -> str:
    """The console as the README shows it: indented four spaces, as a code block."""
    return "".join(f"    {line}\n" if line else "\n" for line in text.rstrip("\n").split("\n"))


def metrics_only(block: str) -> list[str]:
    """A transcript's lines with the machine's figures taken out."""
    return [_MACHINE.sub("#", line) for line in block.splitlines()]


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python scripts/readme_demo.py", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--check", action="store_true", help="compare only; change nothing")
    args = parser.parse_args()
    for page in (README, LANGUAGE_MODELS):
        with open(page, encoding="utf-8") as f:
            if BEGIN not in (text := f.read()) or END not in text:
                sys.exit(f"no {BEGIN} ... {END} block in {page}")
    for directory in DIRS:
        shutil.rmtree(directory, ignore_errors=True)
    tfds_dir = os.environ.get("TFDS_DATA_DIR", os.path.expanduser("~/tensorflow_datasets"))
    shutil.rmtree(os.path.join(tfds_dir, "tiny_translation"), ignore_errors=True)
    # The vocabularies trained on text files too (the language model's run trains one on
    # examples/text; a later run reuses it and would not show the training).
    for name in os.listdir(tfds_dir) if os.path.isdir(tfds_dir) else ():
        trained_on_text = name.startswith(f"{text_files.NAME}_") and "_spm_" in name
        if name.startswith("tiny_translation_spm_") or trained_on_text:
            os.remove(os.path.join(tfds_dir, name))

    start = time.perf_counter()
    demo = run(
        f"python -m trainer --config {TINY} --workdir /tmp/demo --cpu_devices 8", capture=True
    )
    print(demo, end="", flush=True)
    for command in TUTORIAL:
        run(command)
    language_model = run(LM_DEMO, capture=True)
    print(language_model, end="", flush=True)
    print(f"all commands: {time.perf_counter() - start:.0f}s", flush=True)

    same = [
        replace_transcript(page, text, check=args.check)
        for page, text in ((README, demo), (LANGUAGE_MODELS, language_model))
    ]
    if args.check:
        return 0 if all(same) else 1
    shutil.copyfile("/tmp/demo/run.png", PICTURE)
    print(f"rewrote the transcripts in {README} and {LANGUAGE_MODELS}, and {PICTURE}")
    return 0


def replace_transcript(page: str, console: str, *, check: bool) -> bool:
    """Puts ``console`` between ``page``'s markers (``check``: only compares); returns
    whether the page's transcript had this run's metrics."""
    with open(page, encoding="utf-8") as f:  # read now: it may have been edited meanwhile
        text = f.read()
    head, rest = text.split(BEGIN, 1)
    old, tail = rest.split(END, 1)
    new = "\n\n" + transcript_block(console) + "\n"
    same = metrics_only(old) == metrics_only(new)
    if check:
        print(f"{page}: {'the transcript matches this run' if same else 'the transcript differs'}")
    else:
        with open(page, "w", encoding="utf-8") as f:
            f.write(head + BEGIN + new + END + tail)
    return same


if __name__ == "__main__":
    sys.exit(main())
