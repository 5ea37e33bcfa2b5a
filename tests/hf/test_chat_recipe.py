"""docs/chat.md's recipe as a user runs it: a random Llama with Llama 3 Instruct's chat
format made by ``transformers``, fine-tuned on generated additions in chat form,
answering held-out questions through ``transformers`` on the export, with our greedy
answers (``trainer.generate --chat``) and the template the export carries."""

import json
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO, run_command

PAGE = os.path.join(REPO, "docs", "chat.md")


def blocks(language):
    with open(PAGE, encoding="utf-8") as f:
        return re.findall(rf"```{language}\n(.*?)```", f.read(), re.S)


def commands(block):
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


ANSWERS = """
import json, sys
import torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tokenizer = transformers.AutoTokenizer.from_pretrained(sys.argv[1])
for line in open(sys.argv[2]):
    question = json.loads(line)["messages"][0]
    ids = tokenizer.apply_chat_template(
        [question], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    print(json.dumps(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()))
"""


def transformers_answers(model_dir, questions):
    result = subprocess.run(
        [sys.executable, "-c", ANSWERS, model_dir, questions],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
def test_the_chat_recipe_answers_held_out_questions_as_transformers_does(tmp_path):
    pytest.importorskip("transformers")
    paths = {"/tmp/chat_llama": tmp_path / "llama", "/tmp/arithmetic": tmp_path / "data"}
    paths |= {"/tmp/chat_ft": tmp_path / "ft", "/tmp/chat_hf": tmp_path / "hf"}

    def here(text):
        for doc, ours in paths.items():
            text = text.replace(doc, str(ours))
        return text

    for command in commands(blocks("bash")[0]):
        command = here(command).replace("python ", f"{sys.executable} ")
        stdin = None
        if command.startswith("echo "):
            prompt, _, command = command.partition(" | ")
            stdin = re.fullmatch(r'echo "(.*)"', prompt)[1] + "\n"
        result = run_command(["bash", "-c", command], stdin=stdin, timeout=900)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
    heldout = tmp_path / "data" / "heldout.jsonl"
    with open(heldout) as f:
        rows = [json.loads(line) for line in f]
    truth = [row["messages"][1]["content"] for row in rows]
    # The page's own script: how many held-out questions transformers answers.
    printed = subprocess.run(
        [sys.executable, "-c", here(blocks("python")[0])],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    right = int(re.search(r"(\d+) of (\d+) held-out questions answered", printed)[1])
    before = transformers_answers(str(tmp_path / "llama"), str(heldout))
    after = transformers_answers(str(tmp_path / "hf"), str(heldout))
    assert right == sum(a == t for a, t in zip(after, truth, strict=True))
    assert sum(a == t for a, t in zip(before, truth, strict=True)) <= 2  # the random model
    assert right >= 0.6 * len(rows), (right, len(rows))
    # Our Generator's greedy answers are transformers' on the export.
    questions = "".join(row["messages"][0]["content"] + "\n" for row in rows)
    ours = run_command(
        [
            sys.executable,
            "-m",
            "trainer.generate",
            f"--workdir={tmp_path / 'ft'}",
            "--chat",
            "--cpu_devices=8",
            "--max_new_tokens=8",
        ],
        stdin=questions,
    )
    assert ours.returncode == 0, ours.stderr[-3000:]
    assert ours.stdout.splitlines() == [" ".join(a.split()) for a in after]
    print(f"held out: {right} of {len(rows)} answered (before fine-tuning: {before})")
