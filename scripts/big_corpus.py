"""A corpus larger than a run should hold in memory, prepared and trained on, with the
peak resident memory of each process: ``trainer.data.prepare --out`` (tokenizing it
into a token store) and ``python -m trainer`` (memory-mapping that store).

    python scripts/big_corpus.py --gb 2 --dir /tmp/big_corpus [--steps 20]

The corpus is ``--gb`` GB of ``.txt`` files, a document a line: sentences of the
embedded toy language (trainer/input/builders/tiny_translation.py), 200,000 distinct
ones drawn in a seeded order, so that tokenizing costs what real text of that size
costs. Written once into ``--dir`` (kept for re-runs). The run is
``configs/llama.py:text`` on 8 CPU devices for ``--steps`` steps. Prints, per process,
its wall time and peak RSS (``wait4``'s ``ru_maxrss``), and tokens/s of the prepare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from trainer.input.builders import tiny_text, tiny_translation  # noqa: E402

FILE_BYTES = 256 * 2**20  # files of 256 MiB: a corpus as shards, as datasets ship


def write_corpus(directory: str, gigabytes: float) -> list[str]:
    """``directory/part-NNN.txt`` files holding ``gigabytes`` GB of documents."""
    os.makedirs(directory, exist_ok=True)
    done = os.path.join(directory, "DONE")
    if os.path.exists(done):
        return sorted(
            os.path.join(directory, n) for n in os.listdir(directory) if n.endswith(".txt")
        )
    pairs = tiny_translation.generate_pairs(200_000, seed=7)
    lines = np.array([f"{en} {tiny_text.SEPARATOR} {toy}\n".encode() for en, toy in pairs])
    rng = np.random.default_rng(0)
    total, part, paths = int(gigabytes * 1e9), 0, []
    while total > 0:
        path = os.path.join(directory, f"part-{part:03d}.txt")
        with open(path, "wb") as f:
            written = 0
            while written < min(FILE_BYTES, total):
                chunk = b"".join(lines[rng.integers(0, len(lines), 20_000)])
                f.write(chunk)
                written += len(chunk)
        total -= written
        paths.append(path)
        part += 1
    open(done, "w").close()
    return paths


def measured(command: list[str], log: str) -> tuple[float, float]:
    """Runs ``command`` (output to ``log``); its wall seconds and peak RSS in GiB."""
    start = time.perf_counter()
    with open(log, "w") as f:
        process = subprocess.Popen(command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"error: {' '.join(command[2:4])} failed; see {log}")
    return time.perf_counter() - start, usage.ru_maxrss * 1024 / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0, help="corpus size in GB (1e9 bytes)")
    parser.add_argument("--dir", default="/tmp/big_corpus")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    start = time.perf_counter()
    files = write_corpus(os.path.join(args.dir, "text"), args.gb)
    size = sum(os.path.getsize(f) for f in files)
    print(f"corpus: {len(files)} files, {size / 1e9:.2f} GB ({time.perf_counter() - start:.0f}s)")
    config = [
        "--config=configs/llama.py:text",
        f"--config.data.train_files={os.path.join(args.dir, 'text', '*.txt')}",
        f"--config.data.data_dir={os.path.join(args.dir, 'data')}",
    ]
    store = os.path.join(args.dir, "store")
    prepare = [sys.executable, "-m", "trainer.data.prepare", *config, f"--out={store}"]
    seconds, rss = measured(prepare, os.path.join(args.dir, "prepare.log"))
    with open(os.path.join(store, "store.json")) as f:
        tokens = json.load(f)["tokens"]
    print(
        f"prepare: {seconds:.0f}s, {tokens:,} tokens ({tokens / seconds:,.0f} tokens/s, "
        f"{size / seconds / 1e6:.1f} MB/s), peak RSS {rss:.2f} GiB"
    )
    workdir = os.path.join(args.dir, "run")
    shutil.rmtree(workdir, ignore_errors=True)
    train = [
        sys.executable, "-m", "trainer", "--cpu_devices=8", f"--workdir={workdir}", *config,
        f"--config.data.tokenized_dir={store}", f"--config.num_train_steps={args.steps}",
        "--config.steps_per_loop=10", "--config.log_every_steps=10",
        f"--config.eval_every_steps={args.steps}", f"--config.checkpoint_every_steps={args.steps}",
    ]  # fmt: skip
    seconds, rss = measured(train, os.path.join(args.dir, "train.log"))
    print(f"train ({args.steps} steps on the store): {seconds:.0f}s, peak RSS {rss:.2f} GiB")


if __name__ == "__main__":
    main()
