"""Tests of the SentencePiece vocabulary file and the token-length cache of packing."""

import io
import os

import numpy as np
import pytest
from etils import epath

from trainer.input import packing
from trainer.input.tokenizer import load_or_train_sentencepiece


def test_vocab_file_is_first_writer_wins(tmp_path):
    texts = [f"sentence number {i} with words like alpha beta gamma delta" for i in range(300)]
    path = str(tmp_path / "vocab.model")

    def texts_while_another_process_publishes():
        # Simulates a concurrent process that publishes its model while this
        # one is still training: this process must then load that model.
        load_or_train_sentencepiece(path, 40, lambda: texts, description="other")
        return texts

    vocab = load_or_train_sentencepiece(
        path, 50, texts_while_another_process_publishes, description="test"
    )
    assert vocab.vocab_size == 40
    assert os.listdir(tmp_path) == ["vocab.model"]  # No temp files left.

    def must_not_train():
        raise AssertionError("the existing vocabulary should be loaded")

    assert load_or_train_sentencepiece(path, 50, must_not_train, description="x").vocab_size == 40
    with pytest.raises(ValueError, match="vocab_size=30"):
        load_or_train_sentencepiece(path, 30, must_not_train, description="x")


def test_token_lengths_are_cached_and_a_concurrent_writer_wins_harmlessly(tmp_path):
    path = epath.Path(tmp_path) / "vocab.model.abc.split.lengths.npy"
    records = [("a b", "c"), ("d", "e f g"), ("h i j", "k l")]

    def count(batch):  # Words plus EOS, on each side.
        return [(len(r[0].split()) + 1, len(r[1].split()) + 1) for r in batch]

    def read_while_another_process_publishes(indices):
        # Another process finishes counting first: this one's publish must still work.
        other = io.BytesIO()
        np.save(other, np.array([[3, 2], [2, 4], [4, 3]], np.int32))
        path.write_bytes(other.getvalue())
        return [records[i] for i in indices]

    lengths = packing.token_lengths(path, 3, read_while_another_process_publishes, count)
    np.testing.assert_array_equal(lengths, [[3, 2], [2, 4], [4, 3]])
    np.testing.assert_array_equal(np.load(path), lengths)
    assert os.listdir(tmp_path) == [path.name]  # No temporary file left.

    def must_not_read(indices):
        raise AssertionError("the cached lengths should be loaded")

    np.testing.assert_array_equal(packing.token_lengths(path, 3, must_not_read, count), lengths)
    # A cache of another size (the split changed) is recomputed.
    assert packing.token_lengths(path, 2, lambda i: [records[j] for j in i], count).shape == (2, 2)
