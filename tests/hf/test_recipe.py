"""docs/huggingface.md's recipe as a user runs it: a model made by ``transformers``,
imported, fine-tuned 100 steps with wus on 8 devices, continued by trainer.generate,
exported and continued by ``transformers``: the same greedy text."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, run_command

PAGE = os.path.join(REPO, "docs", "huggingface.md")


def blocks(language):
    with open(PAGE, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


def commands(block):
    """The shell commands of ``block``, continuation lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_fine_tuning_recipe_gives_transformers_our_continuation(tmp_path):
    pytest.importorskip("transformers")
    here = str(tmp_path / "my_llama")
    ours = None
    for command in commands(blocks("bash")[0]):
        command = command.replace("/tmp/my_llama", here).replace("python ", f"{sys.executable} ")
        if command.startswith("echo "):
            prompt, _, command = command.partition(" | ")
            stdin = re.fullmatch(r'echo "(.*)"', prompt)[1] + "\n"
        else:
            stdin = None
        result = run_command(["bash", "-c", command], stdin=stdin, timeout=900)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        if stdin is not None:
            ours = result.stdout.strip()
    with open(f"{here}_ft/metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert rows[-1]["step"] == 100 and "eval/perplexity" in rows[-1]
    with open(f"{here}_ft/config.json") as f:
        config = json.load(f)
    assert config["optimizer"]["update_sharding"] == "wus"
    assert config["init_from"] == here
    script = blocks("python")[0].replace("/tmp/my_llama", here)
    theirs = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True
    ).stdout.strip()
    assert ours and theirs == ours
