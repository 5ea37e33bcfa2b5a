"""Paths a user gives: an object store this machine cannot reach fails at once."""

import socket

import pytest

from trainer.input import corpus
from trainer.workdir import storage


@pytest.fixture
def no_network(monkeypatch):
    """Name resolution fails, as on a machine without a network."""

    def fail(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", fail)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    storage._resolves.cache_clear()
    yield
    storage._resolves.cache_clear()


def test_gs_input_without_network_is_one_line_at_once(no_network):
    with pytest.raises(storage.PathError) as caught:
        corpus.expand("gs://bucket/pairs/*.tsv,local.tsv", "data.train_files")
    assert str(caught.value) == (
        "data.train_files gs://bucket/pairs/*.tsv: this machine cannot reach Google Cloud "
        "Storage (storage.googleapis.com: Name or service not known): check its network, "
        "or use a local path"
    )
    with pytest.raises(storage.PathError, match="--workdir gs://bucket/run: this machine"):
        storage.workdir("gs://bucket/run")


def test_local_paths_and_an_emulator_are_not_probed(no_network, monkeypatch, tmp_path):
    storage.check_reachable(tmp_path, "--workdir")  # no network needed
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", "http://127.0.0.1:9023")
    storage.check_reachable("gs://bucket/run", "--workdir")


def test_comma_separated_files_are_the_documented_spelling(tmp_path):
    for name in ("a.tsv", "b.tsv"):
        (tmp_path / name).write_text("x\ty\n")
    files = corpus.expand(f"{tmp_path}/a.tsv,{tmp_path}/b.tsv", "data.train_files")
    assert [f.name for f in files] == ["a.tsv", "b.tsv"]
