"""Makes a small instruction set in chat form: additions asked in a few phrasings,
answered with the sum, for the chat fine-tuning recipe (docs/chat.md) where no real
instruction data is at hand.

Each row is ``{"messages": [{"role": "user", "content": "What is 12 + 7?"},
{"role": "assistant", "content": "19"}]}`` (Hugging Face datasets' form); a seeded
tenth of the pairs of numbers goes to the held-out file instead, asked once with its
answer, for checking what the fine-tuned model answers to questions it never saw. Both
files are written in full under temporary names before either is renamed into place,
so that a run stopped while writing leaves no half-written file.

    python scripts/make_chat_data.py --out /tmp/arithmetic [--largest 19] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import os
import random

PHRASINGS = ("What is {a} + {b}?", "Add {a} and {b}.", "{a} plus {b} is?")


def conversations(largest: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(training, held-out)`` conversations: every pair of numbers up to ``largest``,
    in every phrasing for training; one in ten pairs held out (asked once)."""
    rng = random.Random(seed)
    pairs = [(a, b) for a in range(largest + 1) for b in range(largest + 1)]
    rng.shuffle(pairs)
    held = set(pairs[: len(pairs) // 10])
    train, evals = [], []
    for a, b in sorted(pairs):
        for i, phrasing in enumerate(PHRASINGS):
            row = {
                "messages": [
                    {"role": "user", "content": phrasing.format(a=a, b=b)},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
            if (a, b) not in held:
                train.append(row)
            elif i == 0:
                evals.append(row)
    rng.shuffle(train)
    return train, evals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--largest", type=int, default=19, help="the largest number added")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    train, held = conversations(args.largest, args.seed)
    written = []
    for name, rows in (("train.jsonl", train), ("heldout.jsonl", held)):
        path = os.path.join(args.out, name)
        with open(f"{path}.partial", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        written.append(path)
    for path in written:
        os.replace(f"{path}.partial", path)
    print(f"wrote {len(train)} training and {len(held)} held-out conversations to {args.out}")


if __name__ == "__main__":
    main()
