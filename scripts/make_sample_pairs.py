"""Writes the sample files of ``configs/transformer_1024.py:pairs``:
``examples/text_pairs/train.tsv`` and ``eval.jsonl``.

Sentence pairs of the embedded toy language (trainer/input/builders/tiny_translation.py)
under another seed, so another lexicon: English -> a toy language the ``tiny`` runs never
saw. The files are committed; this script says where they came from and remakes them
byte for byte.

    python scripts/make_sample_pairs.py
"""

import json
import pathlib

from trainer.input.builders import tiny_translation

SEED = 2026
TRAIN, EVAL = 6000, 300
OUT = pathlib.Path(__file__).resolve().parent.parent / "examples" / "text_pairs"


def main() -> None:
    pairs = tiny_translation.generate_pairs(TRAIN + EVAL, seed=SEED)  # distinct sources
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "train.tsv", "w", encoding="utf-8") as f:
        f.writelines(f"{en}\t{toy}\n" for en, toy in pairs[:TRAIN])
    with open(OUT / "eval.jsonl", "w", encoding="utf-8") as f:
        f.writelines(
            json.dumps({"en": en, "toy": toy}, ensure_ascii=False) + "\n"
            for en, toy in pairs[TRAIN:]
        )
    print(f"wrote {TRAIN} pairs to {OUT / 'train.tsv'}, {EVAL} to {OUT / 'eval.jsonl'}")


if __name__ == "__main__":
    main()
