"""A run whose work directory is a ``gs://`` bucket, on a local GCS emulator:
train, stop, resume from the bucket, export from it; against the same run on
a local disk."""

import copy
import json
import os
import struct
import subprocess
import sys
import threading

import fsspec
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, run_command, tiny_command
from etils import epath
from tensorboardX.proto import event_pb2

from launch.local import free_port
from trainer.inference import export as export_lib
from trainer.workdir import storage

pytestmark = pytest.mark.slow  # trains, resumes and exports through an emulated bucket

RUN = "gs://test-bucket/run"
PARAMS = "gs://test-bucket/params"  # the run's export
RUN_CACHE = {"compilation_cache_dir": f"{RUN}/compilation_cache"}  # in the bucket: tested
OVERRIDES = {
    "steps_per_loop": 4,
    "log_every_steps": 4,
    "eval_every_steps": 0,
    "checkpoint_every_steps": 4,
    "data.num_eval_examples": 16,
    "max_decode_length": 8,
}


@pytest.fixture(scope="module")
def emulator():
    """``launch.gcs_emulator`` on a free port, as a user starts it."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "launch.gcs_emulator", f"--port={port}", "--bucket=test-bucket"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ready = proc.stdout.readline()
    assert ready.startswith("ready"), ready + proc.stdout.read()
    # Keep reading what it prints (a line per missing object, tracebacks of clients that
    # hung up): a full pipe would block the emulator, and every run waiting on it.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture
def gcs(emulator):
    """This process reads the emulator too; its settings are undone afterwards."""
    saved_env, saved_conf = dict(os.environ), copy.deepcopy(fsspec.config.conf)
    os.environ["STORAGE_EMULATOR_HOST"] = emulator
    storage.configure()
    yield
    os.environ.clear()
    os.environ.update(saved_env)
    fsspec.config.conf.clear()
    fsspec.config.conf.update(saved_conf)


def succeed(command: list[str], emulator: str) -> str:
    """The output of ``command``, which must succeed, run against the emulator."""
    result = run_command(command, timeout=600, STORAGE_EMULATOR_HOST=emulator)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def tensorboard_scalars(directory: epath.Path, tag: str) -> dict[int, float]:
    """``tag``'s values by step, from every event file (TFRecord framing)."""
    values = {}
    for path in directory.glob("events.out.tfevents.*"):
        data, offset = path.read_bytes(), 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = value.simple_value
    return values


def test_gs_workdir_trains_resumes_and_exports(emulator, gcs, tmp_path):
    data_dir = str(tmp_path / "tfds")
    # The reference: the same 16 steps without a stop, on a local disk, as a command
    # (compiled as the runs below are: this process's programs compile at another
    # level, tests/conftest.py, and the losses must agree to the bit).
    local = run_command(
        tiny_command(str(tmp_path / "local"), data_dir, **OVERRIDES, num_train_steps=16)
    )
    assert local.returncode == 0, local.stderr[-3000:]
    export_lib.export(str(tmp_path / "local"), str(tmp_path / "local_params"))
    with open(tmp_path / "local" / "metrics.jsonl") as f:
        local_losses = {row["step"]: row["loss"] for row in map(json.loads, f)}

    succeed(tiny_command(RUN, data_dir, **OVERRIDES, **RUN_CACHE, num_train_steps=8), emulator)
    out = succeed(
        tiny_command(RUN, data_dir, **OVERRIDES, **RUN_CACHE, num_train_steps=16), emulator
    )
    assert f"resumed from the checkpoint of step 8 in {RUN}/checkpoints" in out
    succeed([sys.executable, "-m", "trainer.export", "--workdir", RUN, "--out", PARAMS], emulator)

    run = epath.Path(RUN)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8, 12, 16]
    assert {r["step"]: r["loss"] for r in rows} == local_losses
    assert tensorboard_scalars(run, "train/loss") == pytest.approx(local_losses, rel=1e-6)
    assert json.loads((run / "config.json").read_text())["num_train_steps"] == 16
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [8, 12, 16]
    assert list((run / "compilation_cache").iterdir())
    # Nothing went to a local directory named after the URL.
    assert not os.path.exists(os.path.join(REPO, "gs:"))

    exported = ocp.StandardCheckpointer().restore(PARAMS)
    reference = ocp.StandardCheckpointer().restore(str(tmp_path / "local_params"))
    for got, want in zip(jax.tree.leaves(exported), jax.tree.leaves(reference), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # Evaluating the run in the bucket prints its metrics and nothing about credentials.
    evaluate = [sys.executable, "-m", "trainer.evaluate", "--workdir", RUN, "--cpu_devices=8"]
    result = run_command(evaluate, timeout=600, STORAGE_EMULATOR_HOST=emulator)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("step 16 | eval/")
    assert "credentials" not in result.stderr.lower(), result.stderr[-3000:]


def test_missing_bucket_is_one_error_line(emulator, tmp_path):
    result = run_command(
        tiny_command("gs://no-such-bucket/run", str(tmp_path / "tfds")),
        STORAGE_EMULATOR_HOST=emulator,
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "error: --workdir gs://no-such-bucket/run: the bucket gs://no-such-bucket does not "
        "exist (or this machine cannot see it): create it first, e.g. gcloud storage buckets "
        "create gs://no-such-bucket"
    ]


def test_dataset_and_vocabulary_in_a_bucket(gcs, tmp_path):
    """An embedded dataset prepared into a gs:// data_dir reads back as the same
    examples as a local copy; a vocabulary is trained once and then loaded."""
    import tensorflow_datasets as tfds

    from trainer.input import tokenizer
    from trainer.input.builders import tiny_translation

    remote, local = "gs://test-bucket/tfds", str(tmp_path / "tfds")
    for data_dir in (remote, local):
        tiny_translation.prepare_tiny_translation(data_dir)
        assert tiny_translation.TinyTranslation(data_dir=data_dir).is_prepared()
    got, want = (
        tfds.data_source("tiny_translation", split="validation", data_dir=d, download=False)
        for d in (remote, local)
    )
    assert len(got) == len(want) == tiny_translation.NUM_VALIDATION
    for i in (0, 1, len(want) - 1):
        assert got[i] == want[i]

    texts = [f"{en} {de}" for en, de in tiny_translation.generate_pairs(300)]
    path = "gs://test-bucket/vocab/tiny.model"
    vocab = tokenizer.load_or_train_sentencepiece(path, 96, lambda: texts, description="t")
    assert epath.Path(path).exists()

    def must_not_train():
        raise AssertionError("trained again instead of loading the saved vocabulary")

    again = tokenizer.load_or_train_sentencepiece(path, 96, must_not_train, description="t")
    assert again.vocab_size == vocab.vocab_size == 96
    assert again.encode(texts[0]) == vocab.encode(texts[0])
