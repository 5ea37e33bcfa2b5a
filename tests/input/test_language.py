"""A language model's input from your own files: the formats as a user writes them,
damaged documents counted, rows that hold the joined documents in one seeded order,
the same batches on any number of processes, a token store equal to the files, and
BERT's masking."""

import gzip
import json
import re

import numpy as np
import pytest
from conftest import data_section, open_pipeline

from trainer.errors import ConfigError
from trainer.input import corpus, text_files, token_store
from trainer.input import tokenizer as tokenizer_lib
from trainer.input.language import features, pipeline
from trainer.input.language import stream as stream_lib

WORDS = [
    "the",
    "a",
    "big",
    "small",
    "dog",
    "cat",
    "sees",
    "finds",
    "river",
    "house",
    "tree",
    "red",
    "green",
    "old",
    "new",
]


def _documents(count: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(3, 12))) for _ in range(count)]


def _config(tmp_path, train, evals, **overrides):
    keys = {
        "train_files": str(train),
        "eval_files": str(evals),
        "document": "line",
        "text_field": "text",
        "tokenizer": "",
        "vocab_size": 32,
        "max_length": 16,
        "num_eval_rows": -1,
        "tokenized_dir": "",
    }
    return data_section("text_files", str(tmp_path / "tfds"), **{**keys, **overrides})


@pytest.fixture
def corpus_files(tmp_path):
    train, evals = tmp_path / "train.txt", tmp_path / "eval.txt"
    train.write_text("".join(d + "\n" for d in _documents(300)))
    evals.write_text("".join(d + "\n" for d in _documents(20, seed=1)))
    return train, evals


def test_every_format_reads_its_documents_and_damage_is_counted_once(tmp_path, capsys):
    (tmp_path / "a.txt").write_bytes(b"first doc\n\nsecond doc\n\xff\xfe bad\n")
    (tmp_path / "b.jsonl.gz").write_bytes(
        gzip.compress(b'{"text": "third"}\n{"other": 1}\n[1]\n{"text": ""}\n{"text": "fourth"}\n')
    )
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    pq.write_table(pa.table({"text": ["fifth", None, "sixth"]}), tmp_path / "c.parquet")
    documents = text_files.read(
        f"{tmp_path}/*.txt,{tmp_path}/*.gz,{tmp_path}/*.parquet", text_files.Reading()
    )
    assert documents.texts == ["first doc", "second doc", "third", "fourth", "fifth", "sixth"]
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning == (
        f"warning: data.train_files: skipped 5 of 11 documents of {tmp_path}/a.txt, "
        f"{tmp_path}/b.jsonl.gz, {tmp_path}/c.parquet: 1 not UTF-8 (first at a.txt:4), "
        "1 not a JSON object (first at b.jsonl.gz:3), 1 missing the text field (first at "
        "b.jsonl.gz:2), 2 empty document (first at b.jsonl.gz:4)"
    )
    # Paragraphs: documents separated by blank lines.
    (tmp_path / "p.txt").write_text("one\ntwo\n\n\nthree\n\nfour\nfive\n")
    paragraphs = text_files.read(str(tmp_path / "p.txt"), text_files.Reading("blank_line"))
    assert paragraphs.texts == ["one\ntwo", "three", "four\nfive"]


@pytest.mark.parametrize(
    "files, message",
    [
        ("{tmp}/nothing*.txt", "data.train_files: no file matches {tmp}/nothing*.txt"),
        ("{tmp}/empty.txt", "data.train_files: no usable document in {tmp}/empty.txt"),
        ("{tmp}/x.csv", r"is not .txt, .jsonl or .parquet \(optionally .gz\)"),
    ],
)
def test_bad_files_are_one_clear_error(tmp_path, files, message):
    (tmp_path / "empty.txt").write_text("\n\n")
    (tmp_path / "x.csv").write_text("a,b\n")
    pattern = message.format(tmp=tmp_path).replace("*", r"\*")
    with pytest.raises(ConfigError, match=pattern):
        text_files.read(files.format(tmp=tmp_path), text_files.Reading())


def test_rows_hold_the_joined_documents_in_one_seeded_order():
    lengths = np.array([5, 3, 9, 2, 7, 4])
    plan = stream_lib.DocumentStream(lengths, row_tokens=5, stride=4, seed=7)
    assert plan.rows_per_epoch == (30 - 5) // 4 + 1
    for epoch in range(2):
        order, starts = plan._epoch(epoch)
        stream = np.concatenate([np.full(lengths[d], d) for d in order])
        within = np.concatenate([np.arange(lengths[d]) for d in order])
        for row in range(plan.rows_per_epoch):
            pieces = plan.pieces(epoch * plan.rows_per_epoch + row)
            got = [(d, t) for d, begin, end in pieces for t in range(begin, end)]
            at = row * 4
            assert got == list(zip(stream[at : at + 5], within[at : at + 5], strict=True))
    assert not np.array_equal(plan._epoch(0)[0], plan._epoch(1)[0])  # reshuffled each epoch


def test_a_target_counts_only_inside_its_own_document():
    tokens = np.array([[3, 10, 11, 1, 3, 20, 21]])
    segments = np.array([[1, 1, 1, 1, 2, 2, 2]])
    batch = features.decoder_batch(tokens, segments, np.array([[0, 1, 2, 3, 0, 1, 2]]))
    np.testing.assert_array_equal(batch["targets"], [[10, 11, 1, 3, 20, 21]])
    # EOS (1) is learnt; the next document's BOS (3) is not predicted from it.
    np.testing.assert_array_equal(batch["weights"], [[1, 1, 1, 0, 1, 1]])


def _batches(config, processes, index, count=3, position=0):
    data = open_pipeline(
        pipeline.make_language_data, config, 8, process_index=index, process_count=processes
    )
    data.train.set_state({"global_batch": position})
    out = [next(data.train) for _ in range(count)]
    data.train.close()
    return out, data


def test_the_same_global_batches_on_any_number_of_processes_and_after_a_resume(
    tmp_path, corpus_files
):
    config = _config(tmp_path, *corpus_files)
    one, data = _batches(config, 1, 0)
    assert data.tokenizer.bos_id == 3 and data.tokenizer.eos_id == 1  # trained on the files
    for processes in (2, 4):
        shares = [_batches(config, processes, p)[0] for p in range(processes)]
        for step, whole in enumerate(one):
            for key, value in whole.items():
                joined = np.concatenate([share[step][key] for share in shares])
                np.testing.assert_array_equal(joined, value)
    resumed, _ = _batches(config, 1, 0, count=1, position=2)
    for key in one[2]:
        np.testing.assert_array_equal(resumed[0][key], one[2][key])
    rows = one[0]
    assert rows["inputs"].shape == (8, 16) and rows["weights"].sum() > 0
    np.testing.assert_array_equal(rows["inputs"][:, 1:], rows["targets"][:, :-1])


def test_a_token_store_gives_the_batches_of_the_files(tmp_path, corpus_files):
    config = _config(tmp_path, *corpus_files)
    from_files, data = _batches(config, 1, 0)
    tokenizer = data.tokenizer
    documents = text_files.iter_documents(
        [corpus_files[0]], text_files.Reading(), corpus.Skipped(text_files.REASONS)
    )
    manifest = token_store.write(tmp_path / "store", documents, tokenizer)
    assert manifest["documents"] == 300 and manifest["dtype"] == "uint16"
    stored = _config(tmp_path, *corpus_files, tokenized_dir=str(tmp_path / "store"))
    from_store, _ = _batches(stored, 1, 0)
    for a, b in zip(from_files, from_store, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key])
    with pytest.raises(ConfigError, match="already exists and is not empty"):
        token_store.write(tmp_path / "store", [], tokenizer)


def test_masking_follows_bert_and_the_row(tmp_path, corpus_files):
    config = _config(tmp_path, *corpus_files, masked=True, mask_rate=0.15, max_predictions=3)
    (rows,), data = _batches(config, 1, 0, count=1)
    assert data.tokenizer.mask_id == 4
    assert rows["masked_positions"].shape == (8, 3)
    weights = rows["masked_weights"].astype(bool)
    # 16 tokens a row, 15%: 2 masked (at most 3); never BOS or EOS.
    assert (weights.sum(1) == 2).all()
    assert not np.isin(rows["masked_ids"][weights], [1, 3]).any()
    # Many rows: about 80% the mask, 10% another token, 10% the same one.
    masking = features.Masking(0.15, 8, 4, 40, (1, 3), seed=0)
    tokens = np.random.default_rng(0).integers(5, 40, (2000, 40))
    masked = masking(np.arange(2000), tokens, np.ones_like(tokens), np.zeros_like(tokens))
    real = masked["masked_weights"].ravel().astype(bool)
    got = np.take_along_axis(masked["inputs"], masked["masked_positions"], axis=1).ravel()[real]
    original = masked["masked_ids"].ravel()[real]
    assert abs(np.mean(got == 4) - 0.8) < 0.02
    assert abs(np.mean((got != 4) & (got == original)) - 0.1 - 0.1 / 35) < 0.02
    # A row's masks are its own: the same on any process, in any batch.
    again = masking(np.arange(1000, 1002), tokens[1000:1002], np.ones((2, 40)), np.zeros((2, 40)))
    np.testing.assert_array_equal(again["inputs"], masked["inputs"][1000:1002])


def test_a_hugging_face_tokenizer_is_used_as_it_is(tmp_path, corpus_files):
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<s>", "</s>"])
    bpe.train([str(corpus_files[0])], trainer)
    directory = tmp_path / "hf"
    directory.mkdir()
    bpe.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    config = _config(tmp_path, *corpus_files, tokenizer=str(directory))
    (rows,), data = _batches(config, 1, 0, count=1)
    # No post-processor adds a BOS, so none is added (transformers' rule); the EOS is
    # tokenizer_config.json's.
    assert (data.tokenizer.bos_id, data.tokenizer.eos_id) == (None, 2)
    first = _documents(1)[0]
    assert data.tokenizer.encode(first) == bpe.encode(first).ids
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        tokenizer_lib.load_text_tokenizer(corpus_files[1].rename(tmp_path / "eval.json"))
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        tokenizer_lib.load_text_tokenizer(tmp_path / "tfds")


@pytest.mark.parametrize("key", ["train_files", "eval_files", "tokenized_dir"])
def test_the_embedded_corpus_refuses_files_named_beside_it(tmp_path, key):
    config = _config(tmp_path, "", "", **{key: str(tmp_path / "mine.txt")})
    config.name = "tiny_text"
    with pytest.raises(ConfigError, match=f"data.{key}=.*is not read: data.name='tiny_text'"):
        open_pipeline(pipeline.make_language_data, config, 8)
    with pytest.raises(ConfigError, match=f"data.{key}="):
        store = str(tmp_path / "store")
        open_pipeline(lambda c, o: pipeline.write_token_store(c, o, store), config, 8)


def _numbers(batches, tokenizer):
    """The document numbers (``doc042``) the rows' pieces show whole."""
    out = set()
    for batch in batches:
        for ids, segments in zip(batch["inputs"], batch["segmentation"], strict=True):
            for s in np.unique(segments[segments > 0]):
                out |= set(re.findall(r"doc\d{3}", tokenizer.decode(ids[segments == s].tolist())))
    return out


def test_without_eval_files_a_seeded_share_of_the_training_documents_is_held_out(tmp_path, capsys):
    # Documents told apart by a number word of their own, so that a piece shows its
    # document.
    numbers = [f"doc{i:03d}" for i in range(200)]
    (tmp_path / "train.txt").write_text("".join(f"{n} the dog sees\n" for n in numbers))
    config = _config(
        tmp_path, tmp_path / "train.txt", "", eval_holdout=0.05, vocab_size=40, max_length=8
    )
    data = open_pipeline(pipeline.make_language_data, config, 8)
    assert "evaluating on 10 of the 200 documents of data.train_files, held out" in (
        capsys.readouterr().err
    )
    held = _numbers(data.eval_batches(), data.tokenizer)
    assert 5 <= len(held) <= 10 and held < set(numbers)
    trained = _numbers([next(data.train) for _ in range(60)], data.tokenizer)
    data.train.close()
    assert not held & trained and len(trained) > 150
    # Process 1 of 2 holds out the same documents (its eval rows are some of them).
    again = open_pipeline(pipeline.make_language_data, config, 8, process_index=1, process_count=2)
    assert _numbers(again.eval_batches(), again.tokenizer) <= held


def test_eval_files_that_are_training_files_are_refused(tmp_path, corpus_files):
    train, _ = corpus_files
    config = _config(tmp_path, train, f"{tmp_path}/*.txt")
    with pytest.raises(ConfigError, match="share 1 file.*train.txt.*would be on training"):
        open_pipeline(pipeline.make_language_data, config, 8)
