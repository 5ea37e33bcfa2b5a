"""Writes the sample documents of ``configs/llama.py:text``: ``examples/text/``.

A folder of text as a user's may be: documents in three formats (one a line in
``train/part-0.txt``, ``{"text": ...}`` lines in ``train/part-1.jsonl.gz``, a ``text``
column in ``train/part-2.parquet``), and ``eval.jsonl``. Each document is a sentence
pair of ``examples/text_pairs/`` (the embedded toy language under another seed) as one
line, ``english => toy``: a language model trained on them continues an English
sentence and ``=>`` with its translation. The files are committed; this script says
where they came from and remakes them byte for byte.

    python scripts/make_sample_text.py
"""

import gzip
import json
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

from trainer.input.builders import tiny_text, tiny_translation

SEED = 2026  # the seed of examples/text_pairs/ (scripts/make_sample_pairs.py)
TXT, JSONL, PARQUET, EVAL = 4000, 1000, 1000, 300
OUT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "text"


def main() -> None:
    pairs = tiny_translation.generate_pairs(TXT + JSONL + PARQUET + EVAL, seed=SEED)
    documents = [f"{en} {tiny_text.SEPARATOR} {toy}" for en, toy in pairs]
    txt, rest = documents[:TXT], documents[TXT:]
    jsonl, rest = rest[:JSONL], rest[JSONL:]
    parquet, evals = rest[:PARQUET], rest[PARQUET:]
    (OUT / "train").mkdir(parents=True, exist_ok=True)
    (OUT / "train" / "part-0.txt").write_text("".join(d + "\n" for d in txt), encoding="utf-8")
    lines = "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in jsonl)
    # mtime=0: the same bytes on every run.
    (OUT / "train" / "part-1.jsonl.gz").write_bytes(gzip.compress(lines.encode(), mtime=0))
    pq.write_table(pa.table({"text": parquet}), OUT / "train" / "part-2.parquet")
    (OUT / "eval.jsonl").write_text(
        "".join(json.dumps({"text": d}, ensure_ascii=False) + "\n" for d in evals),
        encoding="utf-8",
    )
    print(f"wrote {TXT + JSONL + PARQUET} training documents and {EVAL} eval documents to {OUT}")


if __name__ == "__main__":
    main()
