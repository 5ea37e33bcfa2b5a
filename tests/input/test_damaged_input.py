"""Every input a language model reads, damaged as disks, editors and clumsy hands damage
it, is one ConfigError naming the file and the part (a token store's, a corpus's), or
a document skipped for the reason it is: never a traceback, never a wrong number."""

import gzip
import json
import os

import numpy as np
import pytest
from conftest import REPO

from trainer.errors import ConfigError
from trainer.input import corpus, text_files, token_store
from trainer.input import tokenizer as tokenizer_lib

SAMPLE = os.path.join(REPO, "examples", "text", "train", "part-0.txt")
AGAIN = "write it again with python -m trainer.data.prepare --out DIR"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A token store of the sample documents, with a 384-piece SentencePiece model."""
    root = tmp_path_factory.mktemp("store")
    with open(SAMPLE) as f:
        documents = f.read().splitlines()[:500]
    tokenizer = tokenizer_lib.train_text_tokenizer(
        str(root / "spm.model"), 384, lambda: documents, description="the sample"
    )
    manifest = token_store.write(root / "store", documents, tokenizer)
    assert manifest["max_id"] < 384
    return root / "store"


def damaged(store, tmp_path, damage) -> str:
    out = tmp_path / "store"
    out.mkdir()
    for name in os.listdir(store):
        (out / name).write_bytes((store / name).read_bytes())
    damage(out)
    return str(out)


def _cut_tokens(d):
    data = (d / "tokens.bin").read_bytes()
    (d / "tokens.bin").write_bytes(data[: len(data) // 2])


def _manifest(**fields):
    def edit(d):
        manifest = json.loads((d / "store.json").read_text()) | fields
        (d / "store.json").write_text(json.dumps(manifest))

    return edit


def _ids_past_the_vocabulary(d):
    tokens = np.memmap(d / "tokens.bin", dtype="<u2", mode="r+")
    tokens[::50] = 60_000  # as if written with a larger tokenizer (or edited)
    tokens.flush()


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            _cut_tokens,
            r"tokens.bin has [\d,]+ bytes, but store.json says [\d,]+ uint16 tokens .*: it is "
            r"cut short",
        ),
        (_manifest(dtype="uint32"), r"tokens.bin has [\d,]+ bytes, but store.json says .* uint32"),
        (_manifest(dtype="float64"), r"store.json's dtype=\"float64\" is not one a store is"),
        (lambda d: (d / "store.json").write_text("{oops"), r"store.json is not JSON"),
        (_manifest(documents="many"), r"store.json's documents=\"many\" is not a count"),
        (
            _manifest(tokens=10),
            r"offsets.npy \(int64 \(\d+,\)\) is not the start of each of the [\d,]+ documents",
        ),
        (
            lambda d: (d / "offsets.npy").unlink(),
            r"the token store has no offsets.npy, one of its parts",
        ),
        (lambda d: (d / "tokens.bin").unlink(), r"the token store has no tokens.bin"),
        (_manifest(max_id=999), r"its ids reach 999, past the 384 ids of its tokenizer"),
    ],
)
def test_a_damaged_token_store_is_refused_naming_the_part(store, tmp_path, damage, message):
    directory = damaged(store, tmp_path, damage)
    with pytest.raises(ConfigError, match=rf"^data.tokenized_dir={directory}: {message}.*"):
        token_store.TokenStore(directory)


def test_ids_past_the_vocabulary_are_refused_when_a_document_is_read(store, tmp_path):
    # Not 'lower the learning rate': the NaN such ids would give comes from the store.
    directory = damaged(store, tmp_path, _ids_past_the_vocabulary)
    documents = token_store.TokenStore(directory)  # store.json does not know
    with pytest.raises(
        ConfigError,
        match=r"document 0 of the token store has id 60000, past the 384 ids of its "
        rf"tokenizer: tokens.bin was edited or written with another tokenizer; {AGAIN}",
    ):
        documents.tokens(range(len(documents)))


def test_a_whole_store_reads_back(store):
    documents = token_store.TokenStore(store)
    first = documents.tokens([0])[0]
    assert first[0] == documents.tokenizer.bos_id and first[-1] == documents.tokenizer.eos_id


def test_documents_whose_text_is_not_a_string_are_counted_as_such(tmp_path, capsys):
    (tmp_path / "a.jsonl").write_text('{"text": 5}\n{"text": "a document"}\n{"other": 1}\n')
    documents = text_files.read(str(tmp_path / "a.jsonl"), text_files.Reading())
    assert documents.texts == ["a document"]
    (warning,) = capsys.readouterr().err.splitlines()
    assert warning.endswith(
        "1 missing the text field (first at a.jsonl:3), 1 text field not a string (first at "
        "a.jsonl:1)"
    )


def test_a_parquet_column_of_integers_is_refused_not_called_empty(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [1, 2, 3]}), tmp_path / "ints.parquet")
    with pytest.raises(
        ConfigError,
        match=r"ints.parquet's column 'text' holds int64, not text; set data.text_field",
    ):
        text_files.read(str(tmp_path / "ints.parquet"), text_files.Reading())


def test_paths_that_lead_nowhere_are_named_as_such(tmp_path):
    os.symlink("loop.txt", tmp_path / "loop.txt")
    os.symlink(tmp_path / "gone.txt", tmp_path / "dangling.txt")
    with pytest.raises(ConfigError, match=r"loop.txt is a symbolic link in a loop"):
        corpus.expand(str(tmp_path / "loop.txt"), "data.train_files")
    with pytest.raises(
        ConfigError, match=rf"dangling.txt is a symbolic link to {tmp_path}/gone.txt, which does"
    ):
        corpus.expand(str(tmp_path / "dangling.txt"), "data.train_files")
    with pytest.raises(
        ConfigError,
        match=r"^data.train_files: .*/\*\*/\*.txt has '\*\*' \(any depth\), which is not "
        r"supported: name each level with \*",
    ):
        corpus.expand(f"{tmp_path}/**/*.txt", "data.train_files")


def test_a_gzip_file_cut_short_is_named(tmp_path):
    data = gzip.compress(b'{"text": "one"}\n' * 1000)
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"cut.jsonl.gz is not a whole gzip file"):
        text_files.read(str(tmp_path / "cut.jsonl.gz"), text_files.Reading())
