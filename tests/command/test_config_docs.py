"""``python -m trainer --print_config``: every key, its value, its file's default and a
doc read from the config files' own comments."""

import importlib
import os
import subprocess
import sys
import textwrap

import pytest

from trainer.command import config_docs
from trainer.workdir import run_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(
    name.removesuffix(".py")
    for name in os.listdir(os.path.join(ROOT, "configs"))
    if name.endswith(".py") and name not in ("__init__.py", "common.py")
)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_key_of_every_config_and_variant_has_a_doc(name):
    module = importlib.import_module(f"configs.{name}")
    docs = config_docs.key_docs(os.path.join(ROOT, "configs", f"{name}.py"))
    for variant in ["", *getattr(module, "VARIANTS", {})]:
        keys = run_config.flat_config(module.get_config(variant))
        undocumented = [k for k in keys if not config_docs.doc_of(k, docs)]
        assert not undocumented, f"{name}:{variant}: {undocumented}"


def test_docs_are_the_comments_above_at_the_end_of_and_inside_assignments(tmp_path):
    (tmp_path / "mine.py").write_text(
        textwrap.dedent(
            f"""
            import ml_collections
            from {tmp_path.name} import common

            def get_config():
                config = ml_collections.ConfigDict()
                # The learning rate. More words here
                # that are not the first sentence.
                config.lr = 0.1
                config.steps = 10  # Steps to train.
                config.model = ml_collections.ConfigDict(
                    dict(
                        width=3,  # Units per layer.
                        # Layers.
                        depth=2,
                        act="relu",
                    )
                )
                # Mesh sizes by axis.
                config.axes = ml_collections.ConfigDict({{"data": -1}})
                return config
            """
        )
    )
    # Where a key is defined (the imported module) says what it is.
    (tmp_path / "common.py").write_text(
        "config.lr = 1  # Defined here.\nconfig.seed = 0  # Seed.\n"
    )
    docs = config_docs.key_docs(str(tmp_path / "mine.py"))
    assert docs["lr"] == "Defined here." and docs["seed"] == "Seed."
    (tmp_path / "common.py").write_text("config.seed = 0  # Seed.\n")
    docs = config_docs.key_docs(str(tmp_path / "mine.py"))
    assert docs["lr"] == "The learning rate."
    assert docs["steps"] == "Steps to train."
    assert docs["model.width"] == "Units per layer." and docs["model.depth"] == "Layers."
    assert "model.act" not in docs and "axes.data" not in docs
    assert config_docs.doc_of("axes.data", docs) == "Mesh sizes by axis."
    assert config_docs.doc_of("model.act", docs) == ""


def test_print_config_prints_every_key_with_value_default_and_doc(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "--config=configs/transformer_1024.py:tiny",
            "--print_config",
            "--config.seed=7",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    module = importlib.import_module("configs.transformer_1024")
    keys = run_config.flat_config(module.get_config("tiny"))
    assert lines[0].startswith(f"# {len(keys)} keys of --config configs/transformer_1024.py:tiny")
    assert [line.split(" = ")[0] for line in lines[1:]] == list(keys)
    by_key = {line.split(" = ")[0]: line for line in lines[1:]}
    # The comment in configs/common.py, as the file has it; the value as the flag set it.
    with open(os.path.join(ROOT, "configs", "common.py")) as f:
        (seed_line,) = [line for line in f if "config.seed = " in line]
    assert by_key["seed"] == f"seed = 7 (file: 0)  # {seed_line.split('# ', 1)[1].strip()}"
    assert by_key["num_train_steps"].startswith("num_train_steps = 600 (file: 20000)  # ")
    assert by_key["optimizer.b2"].startswith("optimizer.b2 = 0.98  # ")  # the file's own value
    assert all("  # " in line for line in lines[1:])


def test_list_configs_shows_the_variants_that_take_a_value(monkeypatch):
    # A config file's OPTIONS: its variants that take a value (configs/llama.py's hf=DIR).
    from configs import llama
    from trainer.command import cli

    monkeypatch.setattr(
        llama, "OPTIONS", {"hf=DIR": "a Hugging Face model directory on disk"}, raising=False
    )
    lines = cli.list_configs().splitlines()
    assert "      :hf=DIR        a Hugging Face model directory on disk" in lines
