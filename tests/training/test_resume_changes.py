"""A resume says what it changes: the run's recorded config and input against the new
ones, one line each with what it does; another tokenizer is refused unless accepted,
and then the run's own is kept, never overwritten."""

import json
import os
import sys

import pytest
from conftest import run_command

from configs import llama
from trainer.errors import ConfigError
from trainer.training import resume_changes
from trainer.workdir import storage

TOKENIZER = {"tokenizer.model": b"the run's sentencepiece model"}


def recorded_run(tmp_path, **changes):
    """A work directory as a run of configs/llama.py:text leaves it, and that config."""
    config = llama.get_config("text")
    config.update(num_train_steps=800)
    config.optimizer.update(learning_rate=3e-4, warmup_steps=40, end_learning_rate=3e-5)
    directory = storage.path(str(tmp_path))
    (directory / "config.json").write_text(config.to_json_best_effort())
    for name, content in TOKENIZER.items():
        (directory / name).write_bytes(content)
    record = {"corpus": "abc", "files": [["/corpus/a.txt", 1_000_000]], "documents": 7505}
    resume_changes.write_input_record(directory, record)
    config.update_from_flattened_dict(changes)
    return directory, config, record


def test_a_shorter_schedule_says_the_learning_rate_it_moves_to(tmp_path):
    directory, config, record = recorded_run(tmp_path, num_train_steps=320)
    lines = [c.line() for c in resume_changes.compare(directory, config, TOKENIZER, record, 400)]
    assert lines == [
        "num_train_steps: 800 -> 320",
        # Cosine from 3e-4 to 3e-5 over 760 steps after a warm-up of 40: at step 400,
        # 3e-4 (0.1 + 0.9 (1 + cos(pi 360/760)) / 2) = 1.76e-4; the 320-step schedule has
        # ended there (3e-5).
        "learning rate at step 400: 0.000176 -> 3e-05: the schedule's rate where the run goes on",
    ]


def test_a_warmup_share_moves_the_learning_rate_too(tmp_path):
    changes = {"optimizer.warmup_steps": 0, "optimizer.warmup_ratio": 0.5}
    directory, config, record = recorded_run(tmp_path, **changes)
    lines = [c.line() for c in resume_changes.compare(directory, config, TOKENIZER, record, 100)]
    # Warm-up of 400 steps (half of 800): at step 100, 3e-4 x 100/400 = 7.5e-5; before,
    # cosine 60 steps into 760 after 40: 3e-4 (0.1 + 0.9 (1 + cos(pi 60/760)) / 2) = 2.96e-4.
    assert lines[-1] == (
        "learning rate at step 100: 0.000296 -> 7.5e-05: the schedule's rate where the run goes on"
    )


def test_rows_of_another_length_and_a_grown_corpus_are_said(tmp_path):
    directory, config, record = recorded_run(tmp_path, **{"data.max_length": 32})
    grown = {"corpus": "abd", "files": [*record["files"], ["/corpus/b.txt", 500_000]]}
    grown["documents"] = 9000
    changes = resume_changes.compare(directory, config, TOKENIZER, grown, 400)
    lines = [c.line() for c in changes]
    assert lines[0].startswith("data.max_length: 64 -> 32: rows of another length")
    assert lines[1] == (
        "data.train_files: 1 file(s), 1.00 MB, 7,505 documents -> 2 file(s), 1.50 MB, 9,000 "
        "documents: another corpus: the steps from here on read another order of documents "
        "(the input position indexes the new corpus's shuffle)"
    )
    assert len(lines) == 2


def test_another_tokenizer_is_refused_and_kept_when_accepted(tmp_path):
    directory, config, record = recorded_run(tmp_path)
    other = {"tokenizer.model": b"another model"}
    with pytest.raises(ConfigError, match="trained with another tokenizer.*--accept_new_tokenizer"):
        resume_changes.compare(directory, config, other, record, 400)
    changes = resume_changes.compare(
        directory, config, other, record, 400, accept_new_tokenizer=True
    )
    assert [c.what for c in changes] == ["tokenizer"]
    assert "kept as tokenizer.model.before-step-400" in changes[0].line()
    resume_changes.set_aside_old_files(directory, other, 400)
    assert (directory / "tokenizer.model.before-step-400").read_bytes() == TOKENIZER[
        "tokenizer.model"
    ]


def test_an_unchanged_resume_says_nothing(tmp_path):
    directory, config, record = recorded_run(tmp_path)
    assert resume_changes.compare(directory, config, TOKENIZER, record, 400) == []


@pytest.mark.slow  # three short training runs of the :text decoder (compiles)
def test_a_resume_with_another_tokenizer_is_one_line_and_the_run_keeps_its_own(tmp_path):
    workdir = str(tmp_path / "run")
    flags = [
        "--config=configs/llama.py:text",
        f"--workdir={workdir}",
        "--cpu_devices=8",
        f"--config.data.data_dir={tmp_path / 'data'}",
        "--config.num_train_steps=20",
        "--config.steps_per_loop=10",
        "--config.log_every_steps=10",
        "--config.eval_every_steps=0",
        "--config.eval_at_start=false",
        "--config.checkpoint_every_steps=10",
    ]
    command = [sys.executable, "-m", "trainer", *flags]
    first = run_command(command)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = (tmp_path / "run" / "tokenizer.model").read_bytes()
    # The same corpus, a SentencePiece model of another size: another tokenizer.
    other = [*command, "--config.num_train_steps=30", "--config.data.vocab_size=300"]
    refused = run_command(other)
    assert refused.returncode != 0
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .startswith("error: this run was trained with another tokenizer")
    )
    assert (tmp_path / "run" / "tokenizer.model").read_bytes() == kept
    accepted = run_command([*other, "--accept_new_tokenizer"])
    assert accepted.returncode == 0, accepted.stderr[-3000:]
    said = accepted.stdout
    assert "resuming at step 20 with 3 change(s) to the run:" in said
    assert "  num_train_steps: 20 -> 30" in said
    assert "  data.vocab_size: 384 -> 300" in said
    assert (tmp_path / "run" / "tokenizer.model.before-step-20").read_bytes() == kept
    with open(os.path.join(workdir, "input.json")) as f:
        assert json.load(f)["documents"] > 1000
