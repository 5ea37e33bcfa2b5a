"""Tests of the translation input pipeline (tiny_translation, mocked WMT, synthetic)."""

import importlib.util
import json
import os
import sys

import ml_collections
import numpy as np
import pytest
import tensorflow_datasets as tfds
from conftest import data_section, open_pipeline

# Registers the WMT builder class, which `tfds.testing.mock_data` needs to fake
# the dataset from code (real runs read prepared files without it).
from tensorflow_datasets.translate import wmt14  # noqa: F401

from trainer.errors import UserError
from trainer.input import feed, packing
from trainer.input.builders import tiny_translation
from trainer.input.source import DatasetNotPreparedError
from trainer.input.tokenizer import EOS_ID, SyntheticVocab
from trainer.input.translation import FEATURE_KEYS, make_translation_data

WMT = "wmt14_translate/de-en"


def _config(data_dir, **overrides) -> ml_collections.ConfigDict:
    return data_section(
        "tiny_translation",
        data_dir,
        **{
            "source_lang": "en",
            "target_lang": "de",
            "vocab_path": None,
            "vocab_size": 384,
            "max_length": 64,
            "pack": False,
            "eval_split": "validation",
            "num_eval_examples": -1,
            **overrides,
        },
    )


def _make(config, global_batch_size=8, **where):
    return open_pipeline(make_translation_data, config, global_batch_size, **where)


def _take(iterator, n):
    return [next(iterator) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A TFDS data_dir with tiny_translation prepared and its vocabulary trained."""
    data_dir = tmp_path_factory.mktemp("tfds")
    tiny_translation.prepare_tiny_translation(str(data_dir))
    _make(_config(data_dir))  # Trains and saves the SentencePiece model.
    return data_dir


@pytest.fixture(scope="session")
def pairs():
    """English -> toy-German for every tiny_translation example."""
    num = tiny_translation.NUM_TRAIN + tiny_translation.NUM_VALIDATION
    return dict(tiny_translation.generate_pairs(num))


def _segments(tokens, segmentation, position):
    """Checks one packed/padded row and returns the token arrays of its examples."""
    used = int((segmentation > 0).sum())
    # Real tokens form a prefix; everything after it is zero.
    assert (segmentation[:used] > 0).all()
    for array in (tokens, segmentation, position):
        assert not array[used:].any()
    segments = []
    for segment_id in range(1, int(segmentation.max()) + 1):
        (index,) = np.nonzero(segmentation == segment_id)
        assert index.size > 0 and (np.diff(index) == 1).all(), "segment ids not contiguous"
        np.testing.assert_array_equal(position[index], np.arange(index.size))
        segment = tokens[index]
        assert segment[-1] == EOS_ID and (segment[:-1] != EOS_ID).all() and segment.all()
        segments.append(segment)
    return segments


def test_tiny_dataset_is_prepared_without_tensorflow(tiny_dir):
    assert importlib.util.find_spec("tensorflow") is None
    assert "tensorflow" not in sys.modules
    for split, size in [("train", 20_000), ("validation", 500)]:
        source = tfds.data_source("tiny_translation", split=split, data_dir=str(tiny_dir))
        assert len(source) == size
    version_dir = tiny_dir / "tiny_translation" / "1.0.0"
    assert len(list(version_dir.glob("tiny_translation-train.array_record-*"))) == 1
    info_mtime = (version_dir / "dataset_info.json").stat().st_mtime_ns
    tiny_translation.prepare_tiny_translation(str(tiny_dir))  # Idempotent: a no-op.
    assert (version_dir / "dataset_info.json").stat().st_mtime_ns == info_mtime
    assert not [p for p in os.listdir(tiny_dir) if p.startswith(".tiny_translation-")]


def test_tiny_corpus_is_deterministic_and_a_reordered_translation(tiny_dir):
    generate = tiny_translation.generate_pairs
    assert generate(20, seed=7) == generate(20, seed=7) != generate(20, seed=8)
    lexicon = tiny_translation.lexicon()
    assert len(lexicon) > 190 and len(set(lexicon.values())) == len(lexicon)
    assert not set(lexicon.values()) & set(lexicon)
    verbs = {lexicon[verb] for verb in tiny_translation.verbs()}

    source = tfds.data_source("tiny_translation", split="validation", data_dir=str(tiny_dir))
    stored = {(ex["en"].decode(), ex["de"].decode()) for ex in source}
    generated = tiny_translation.generate_pairs(20_500)
    assert stored == set(generated[20_000:])  # Same seed -> same examples.
    reordered = 0
    for en, de in stored:
        en_words, de_words = en.split(), de.split()
        assert 3 <= len(en_words) <= 12
        assert sorted(de_words) == sorted(lexicon[w] for w in en_words)
        assert de_words[-1] in verbs  # The verb moved to the end.
        reordered += de_words != [lexicon[w] for w in en_words]
    assert reordered > 0.8 * len(stored)  # Word-by-word is not enough.


def test_unpacked_train_batches_decode_to_the_pairs(tiny_dir, pairs):
    data = _make(_config(tiny_dir, pack=False))
    for batch in _take(data.train, 3):
        assert set(batch) == set(FEATURE_KEYS)
        for value in batch.values():
            assert value.shape == (8, 64) and value.dtype == np.int32
        for row in range(8):
            for key in ("inputs", "targets"):
                tokens = batch[key][row]
                np.testing.assert_array_equal(batch[f"{key}_segmentation"][row], tokens != 0)
                segments = _segments(
                    tokens, batch[f"{key}_segmentation"][row], batch[f"{key}_position"][row]
                )
                assert len(segments) == 1
            en = data.vocab.decode(batch["inputs"][row])
            assert pairs[en] == data.vocab.decode(batch["targets"][row])


def test_packed_train_batches_hold_whole_examples(tiny_dir, pairs):
    data = _make(_config(tiny_dir, pack=True))
    examples_per_row = []
    for batch in _take(data.train, 3):
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
            k: ((8, 64), np.int32) for k in FEATURE_KEYS
        }
        for row in range(8):
            inputs = _segments(
                batch["inputs"][row],
                batch["inputs_segmentation"][row],
                batch["inputs_position"][row],
            )
            targets = _segments(
                batch["targets"][row],
                batch["targets_segmentation"][row],
                batch["targets_position"][row],
            )
            assert len(inputs) == len(targets)
            examples_per_row.append(len(inputs))
            # Each segment pair is one complete example: it decodes to a pair.
            for source, target in zip(inputs, targets, strict=True):
                assert pairs[data.vocab.decode(source)] == data.vocab.decode(target)
    assert max(examples_per_row) >= 2 and np.mean(examples_per_row) > 1.5


def _assert_same(want, got):
    assert set(want) == set(got)
    for key in want:
        np.testing.assert_array_equal(want[key], got[key])


def _concat(batches):
    return {key: np.concatenate([b[key] for b in batches]) for key in batches[0]}


def test_processes_take_blocks_of_one_global_order(tiny_dir):
    # 960 pairs, 32 rows per global batch: one epoch is 30 steps for any process count.
    config = _config(tiny_dir, train_split="train[:960]", pack=False)

    def rows(batches):
        return [row.tobytes() for b in batches for row in b["inputs"]]

    single = _take(_make(config, global_batch_size=32).train, 60)
    epoch1, epoch2 = rows(single[:30]), rows(single[30:])
    assert len(set(epoch1)) == 960 and set(epoch2) == set(epoch1)
    assert epoch2 != epoch1  # Reshuffled every epoch.
    for count in (2, 4):
        shares = [
            _make(config, global_batch_size=32, process_index=i, process_count=count).train
            for i in range(count)
        ]
        # Process i reads its block of rows of every global batch of the one order.
        for want in single[:31]:
            _assert_same(want, _concat([next(share) for share in shares]))


@pytest.mark.parametrize("pack", [False, True])
def test_train_iterator_resumes_from_saved_state(tiny_dir, pack):
    config = _config(tiny_dir, pack=pack)
    data = _make(config, seed=3)
    assert isinstance(data.train, feed.TrainBatches)
    _take(data.train, 3)
    state = data.train.get_state()
    assert json.loads(json.dumps(state)) == {"global_batch": 3}  # One global number.
    expected = _take(data.train, 2)
    restored = _make(config, seed=3).train
    restored.set_state(state)
    for want, got in zip(expected, _take(restored, 2), strict=True):
        _assert_same(want, got)


def test_position_of_two_processes_resumes_on_one(tiny_dir):
    config = _config(tiny_dir, pack=True)
    shares = [_make(config, seed=4, process_index=i, process_count=2).train for i in range(2)]
    for _ in range(5):
        for share in shares:
            next(share)
    states = [share.get_state() for share in shares]
    assert states[0] == states[1]
    next_two = [_take(share, 2) for share in shares]
    single = _make(config, seed=4).train
    single.set_state(states[0])
    for step, got in enumerate(_take(single, 2)):
        _assert_same(_concat([next_two[0][step], next_two[1][step]]), got)


def test_worker_processes_give_the_same_batches(tiny_dir):
    expected = _take(_make(_config(tiny_dir, pack=True), seed=2).train, 6)
    workers = _make(_config(tiny_dir, pack=True, worker_count=2), seed=2).train
    try:
        for want, got in zip(expected[:4], _take(workers, 4), strict=True):
            _assert_same(want, got)
        workers.set_state(workers.get_state())  # Restarts the workers at batch 4.
        for want, got in zip(expected[4:], _take(workers, 2), strict=True):
            _assert_same(want, got)
    finally:
        workers.close()


def test_packing_plan_covers_each_epoch_once_and_packs_tightly(tiny_dir):
    vocab_path = tiny_dir / "tiny_translation_spm_384.model"
    path = packing.lengths_path(str(vocab_path), "tiny_translation", "train")
    lengths = np.load(path)
    assert lengths.shape == (20_000, 2) and lengths.min() >= 2
    plan = packing.RowPlan(lengths, 24, pack=True, seed=1, name="t")
    assert 0 < len(plan.kept) < 20_000  # Some pairs are longer than 24 tokens.
    epoch_rows = [len(plan._compute(epoch)[2]) for epoch in (0, 1)]  # Counts may differ.
    rows = plan.rows(np.arange(sum(epoch_rows)))
    epochs = rows[: epoch_rows[0]], rows[epoch_rows[0] :]
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(np.concatenate(epoch)), plan.kept)
        assert all((lengths[r].sum(axis=0) <= 24).all() for r in epoch)
    # Target tokens fill > 90% of 48-token rows (packing pairs in order fills ~75%).
    tight = packing.RowPlan(lengths, 48, pack=True, seed=1, name="t")
    assert len(tight.kept) == 20_000
    assert lengths[:, 1].sum() / (len(tight._compute(0)[2]) * 48) > 0.9
    assert [r.tolist() for r in epochs[0]] != [r.tolist() for r in epochs[1]]
    # Back to the first epoch (a resumed position, or a worker started from a copy).
    again = plan.rows(np.arange(5))
    assert [r.tolist() for r in again] == [r.tolist() for r in rows[:5]]


def test_eval_batches_are_padded_equally_and_match_references(tiny_dir):
    config = _config(tiny_dir, num_eval_examples=33)
    source = tfds.data_source("tiny_translation", split="validation", data_dir=str(tiny_dir))
    all_sources = []
    for index in range(2):
        data = _make(config, global_batch_size=16, process_index=index, process_count=2)
        batches = list(data.eval_batches())
        sources, targets = data.eval_references()
        # 17 + 16 examples: process 1 needs only 2 batches but must run 3 like process 0.
        assert len(batches) == 3
        assert len(sources) == len(targets) == (17 if index == 0 else 16)
        rows = {k: np.concatenate([b[k] for b in batches]) for k in FEATURE_KEYS}
        assert rows["inputs"].shape == (24, 64)
        for key in FEATURE_KEYS:
            assert not rows[key][len(sources) :].any()  # Padding rows are all zero.
        for row, (src, tgt) in enumerate(zip(sources, targets, strict=True)):
            assert data.vocab.decode(rows["inputs"][row]) == src
            assert data.vocab.decode(rows["targets"][row]) == tgt
            np.testing.assert_array_equal(rows["inputs_segmentation"][row], rows["inputs"][row] > 0)
        again = list(data.eval_batches())  # A fresh iterable each call.
        np.testing.assert_array_equal(again[0]["targets"], batches[0]["targets"])
        all_sources.append(sources)
    # Process i owns validation examples i, i+2, ...
    assert all_sources[0] == [source[i]["en"].decode() for i in range(0, 33, 2)]
    assert all_sources[1] == [source[i]["en"].decode() for i in range(1, 33, 2)]


def test_eval_truncates_long_examples_and_keeps_eos(tiny_dir):
    data = _make(_config(tiny_dir, max_length=10, num_eval_examples=40), global_batch_size=40)
    (batch,) = list(data.eval_batches())
    truncated = 0
    for key, texts in zip(("inputs", "targets"), data.eval_references(), strict=True):
        for row, text in enumerate(texts):
            (segment,) = _segments(
                batch[key][row], batch[f"{key}_segmentation"][row], batch[f"{key}_position"][row]
            )
            full = data.vocab.encode(text)
            truncated += len(full) > 10
            np.testing.assert_array_equal(segment, full if len(full) <= 10 else full[:9] + [EOS_ID])
    assert truncated > 0


def test_wmt_pipeline_on_mock_data(tmp_path):
    config = _config(tmp_path, name=WMT, vocab_size=64, max_length=32, pack=True, eval_split="test")
    with tfds.testing.mock_data(num_examples=200, policy=tfds.testing.MockPolicy.USE_CODE):
        data = _make(config, global_batch_size=8, process_index=1, process_count=2)
        batches = _take(data.train, 3)
    assert (tmp_path / "wmt14_translate_de-en_spm_64.model").exists()
    assert len(list(tmp_path.glob("wmt14_translate_de-en_spm_64.model.*.lengths.npy"))) == 1
    assert data.vocab.vocab_size == 64
    examples_per_row = []
    for batch in batches:
        assert {k: v.shape for k, v in batch.items()} == {k: (4, 32) for k in FEATURE_KEYS}
        for row in range(4):
            inputs = _segments(
                batch["inputs"][row],
                batch["inputs_segmentation"][row],
                batch["inputs_position"][row],
            )
            examples_per_row.append(len(inputs))
    assert max(examples_per_row) >= 2
    sources, targets = data.eval_references()
    assert len(sources) == len(targets) == 100
    first = next(iter(data.eval_batches()))
    # SentencePiece normalises runs of spaces in the random mock text.
    assert data.vocab.decode(first["targets"][0]) == " ".join(targets[0].split())


# The made-up name has no builder code, like WMT in a run that reads prepared files.
@pytest.mark.parametrize("name", [WMT, "made_up_translate/de-en"])
def test_missing_tfds_dataset_raises_a_clear_error(tmp_path, name):
    with pytest.raises(DatasetNotPreparedError) as error:
        _make(_config(tmp_path, name=name, vocab_size=32000, eval_split="test"))
    message = str(error.value)
    assert isinstance(error.value, UserError) and "\n" not in message
    assert f"'{name}'" in message
    assert f"tfds build {name} --file_format=array_record --data_dir={tmp_path}" in message


def test_synthetic_data_is_deterministic_and_sharded():
    config = _config(
        None, name="synthetic", vocab_size=100, max_length=16, pack=True, num_eval_examples=12
    )
    data = _make(config, seed=5)
    first, second = _take(data.train, 2)
    assert {k: (v.shape, v.dtype) for k, v in first.items()} == {
        k: ((8, 16), np.int32) for k in FEATURE_KEYS
    }
    assert ((first["inputs"][:, :-1] >= 3) & (first["inputs"][:, :-1] < 100)).all()
    assert (first["targets"][:, -1] == EOS_ID).all() and (first["inputs_segmentation"] == 1).all()
    np.testing.assert_array_equal(first["targets_position"], np.tile(np.arange(16), (8, 1)))
    again = _make(config, seed=5).train
    np.testing.assert_array_equal(next(again)["inputs"], first["inputs"])
    assert not np.array_equal(next(_make(config, seed=6).train)["inputs"], first["inputs"])
    for index in range(2):
        shard = next(_make(config, seed=5, process_index=index, process_count=2).train)
        np.testing.assert_array_equal(shard["inputs"], first["inputs"][4 * index : 4 * index + 4])
    state = data.train.get_state()
    expected = next(data.train)
    again.set_state(state)
    np.testing.assert_array_equal(next(again)["targets"], expected["targets"])
    assert not np.array_equal(expected["targets"], second["targets"])
    batches = list(data.eval_batches())
    sources, _ = data.eval_references()
    assert len(batches) == 2 and len(sources) == 12 and not batches[1]["inputs"][4:].any()
    assert sources[0] == " ".join(str(i) for i in batches[0]["inputs"][0][:-1])


def test_vocab_encode_decode(tiny_dir):
    vocab = _make(_config(tiny_dir)).vocab
    assert (vocab.pad_id, vocab.eos_id, vocab.vocab_size) == (0, 1, 384)
    text = "the big dog sees a cat"
    ids = vocab.encode(text)
    assert ids[-1] == EOS_ID and EOS_ID not in ids[:-1] and 0 not in ids
    assert vocab.decode(ids + [0, 0]) == text
    assert vocab.decode([ids[0], 0] + ids[1:]) == text  # PAD is skipped.
    assert vocab.decode(ids[:2] + [EOS_ID] + ids[2:]) == vocab.decode(ids[:2])
    synthetic = SyntheticVocab(10)
    assert synthetic.encode("4 5 12") == [4, 5, 2, EOS_ID]
    assert synthetic.decode([4, 5, 0, 1, 7]) == "4 5"


def test_bad_configs_fail_early(tiny_dir):
    with pytest.raises(
        ValueError, match="global_batch_size=9 must be a positive multiple of process_count=2"
    ):
        _make(_config(tiny_dir), global_batch_size=9, process_count=2)
    config = _config(tiny_dir)
    del config["max_length"]
    with pytest.raises(ValueError, match="max_length"):
        _make(config)
    with pytest.raises(ValueError, match="source_lang"):
        _make(_config(tiny_dir, source_lang="fr"))
