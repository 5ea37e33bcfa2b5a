"""Your own sentence pairs (``data.name="text_pairs"``): files read as a user writes
them, damaged rows counted, and the same global order and per-process split as TFDS."""

import gzip
import json

import numpy as np
import pytest
from conftest import data_section, open_pipeline

from configs import transformer_1024
from trainer.errors import ConfigError
from trainer.input import text_pairs
from trainer.input.translation import load_vocab, make_translation_data

GOOD = [(f"source {i} words", f"ziel {i} wörter") for i in range(40)]
_SOURCE = ("ka", "lo", "mi", "nu", "pe", "ra", "so", "ti", "vu", "we")
_TARGET = ("ba", "de", "fi", "go", "hu", "ja", "ke", "li", "mo", "ny")


def _spell(number: int, syllables) -> str:
    return " ".join(syllables[int(d)] for d in f"{number:03d}")


def _write_tsv(path, pairs, extra=b""):
    path.write_bytes(b"".join(f"{s}\t{t}\n".encode() for s, t in pairs) + extra)
    return path


def _config(tmp_path, train, eval_files, **overrides):
    return data_section(
        "text_pairs",
        str(tmp_path / "tfds"),
        **{
            "source_lang": "en",
            "target_lang": "xx",
            "vocab_path": None,
            "vocab_size": 32,
            "max_length": 16,
            "pack": False,
            "eval_split": "unused",
            "num_eval_examples": -1,
            "train_files": train,
            "eval_files": eval_files,
            **overrides,
        },
    )


def test_tsv_jsonl_and_gzip_read_in_sorted_file_order(tmp_path):
    _write_tsv(tmp_path / "b.tsv", GOOD[10:20])
    (tmp_path / "a.jsonl.gz").write_bytes(
        gzip.compress("".join(json.dumps({"en": s, "xx": t}) + "\n" for s, t in GOOD[:10]).encode())
    )
    (tmp_path / "c.txt").write_bytes(
        b"".join(f"{s}\t{t}\r\n".encode() for s, t in GOOD[20:25])  # Windows line ends
    )
    pairs = text_pairs.read(str(tmp_path / "*"), "en", "xx", key="data.train_files")
    assert [p["en"] for p in pairs] == [s for s, _ in GOOD[:25]]
    assert [p["xx"] for p in pairs] == [t for _, t in GOOD[:25]]
    assert pairs.skipped.total == 0
    assert [f.rsplit("/", 1)[1] for f in pairs.files] == ["a.jsonl.gz", "b.tsv", "c.txt"]


def test_damaged_rows_are_skipped_and_counted_by_reason(tmp_path, capsys):
    damaged = (
        b"no tab here\n"  # line 41
        b"one\ttwo\tthree\n"  # 42
        b"\tonly a target\n"  # 43
        b"bad \xff\xfe bytes\tziel\n"  # 44
        b"   \t  \n"  # 45
        b"no tab either\n"  # 46
    )
    _write_tsv(tmp_path / "train.tsv", GOOD, extra=damaged)
    (tmp_path / "eval.jsonl").write_text(
        '{"en": "a", "xx": "b"}\n[1, 2]\n{"en": "c"}\nnot json\n{"en": "d", "xx": 5}\n'
    )
    pairs = text_pairs.read(str(tmp_path / "train.tsv"), "en", "xx", key="data.train_files")
    assert len(pairs) == 40
    assert dict(pairs.skipped.counts) == {
        "no tab": 2,
        "more than one tab": 1,
        "empty side": 2,
        "not UTF-8": 1,
    }
    assert pairs.skipped.first == {
        "no tab": "train.tsv:41",
        "more than one tab": "train.tsv:42",
        "empty side": "train.tsv:43",
        "not UTF-8": "train.tsv:44",
    }
    warning = capsys.readouterr().err
    assert warning.startswith("warning: data.train_files: skipped 6 of 46 rows of ")
    assert "2 no tab (first at train.tsv:41)" in warning and warning.count("\n") == 1
    evals = text_pairs.read(str(tmp_path / "eval.jsonl"), "en", "xx", key="data.eval_files")
    assert [p["en"] for p in evals] == ["a"]
    assert dict(evals.skipped.counts) == {"not a JSON object": 2, "missing a language key": 2}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ((), "data.train_files is empty"),
        (("{dir}/none*.tsv",), "no file matches .*none\\*\\.tsv"),
        (("{dir}/missing.tsv",), "no file matches .*missing.tsv"),
        (("{dir}/pairs.csv",), "pairs.csv is not .tsv, .txt or .jsonl"),
        (("{dir}/sub",), "sub is a directory"),
        (("{dir}/broken.tsv.gz",), "broken.tsv.gz is not a whole gzip file"),
        (("{dir}/all_bad.tsv",), "no usable sentence pair in .*all_bad.tsv: 2 no tab"),
    ],
)
def test_bad_files_are_one_clear_error(tmp_path, files, message):
    (tmp_path / "pairs.csv").write_text("a,b\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "broken.tsv.gz").write_bytes(gzip.compress(b"a\tb\n")[:-5])
    (tmp_path / "all_bad.tsv").write_text("x\ny\n")
    patterns = tuple(f.format(dir=tmp_path) for f in files)
    with pytest.raises(ConfigError, match=message):
        text_pairs.read(patterns, "en", "xx", key="data.train_files")


def test_processes_take_blocks_of_one_global_order(tmp_path):
    # Few letters: every pair stays distinct under a small vocabulary.
    many = [(_spell(i, _SOURCE), _spell(i * 7 % 96, _TARGET)) for i in range(96)]
    _write_tsv(tmp_path / "train.tsv", many)
    _write_tsv(tmp_path / "eval.tsv", GOOD[:10])
    config = _config(tmp_path, (str(tmp_path / "train.tsv"),), (str(tmp_path / "eval.tsv"),))
    single = open_pipeline(make_translation_data, config, 16)
    batches = [next(single.train) for _ in range(12)]  # two epochs of 6 batches
    first = {row.tobytes() for b in batches[:6] for row in b["inputs"]}
    assert len(first) == 96  # every pair once an epoch
    for index, batch in enumerate(batches):  # each row decodes to a pair of the file
        for row in range(16):
            source = single.vocab.decode(batch["inputs"][row])
            assert single.vocab.decode(batch["targets"][row]) == dict(many)[source], index
    shares = [
        open_pipeline(make_translation_data, config, 16, process_index=i, process_count=2).train
        for i in range(2)
    ]
    for want in batches:
        got = [next(share) for share in shares]
        for key in want:
            np.testing.assert_array_equal(want[key], np.concatenate([g[key] for g in got]))
    # The eval pairs and their references, whole.
    assert single.eval_references() == ([s for s, _ in GOOD[:10]], [t for _, t in GOOD[:10]])
    # The vocabulary is named after the training files' bytes, and found again from them.
    (vocab_file,) = (tmp_path / "tfds").glob("text_pairs_*_spm_32.model")
    assert load_vocab(config).serialized == vocab_file.read_bytes() == single.vocab.serialized


def test_the_pairs_variant_reads_the_shipped_sample():
    data = transformer_1024.get_config("pairs").data
    train = text_pairs.read(data.train_files, data.source_lang, data.target_lang, key="train")
    evals = text_pairs.read(data.eval_files, data.source_lang, data.target_lang, key="eval")
    assert (len(train), len(evals), train.skipped.total, evals.skipped.total) == (6000, 300, 0, 0)
    assert not {p["en"] for p in train} & {p["en"] for p in evals}  # held out
