"""The decoder and BERT end to end through the trainer, on the embedded tiny_text
corpus: every update mode trains the same numbers, a resume is bit-exact, evaluation
does not depend on the devices, and the Generator continues prompts from a run as
the command line does."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
from conftest import RUNS_LONG, run_command

from configs import bert_large, llama
from trainer.errors import UserError
from trainer.training import train as train_lib

STEPS = {
    "num_train_steps": 40,
    "steps_per_loop": 20,
    "log_every_steps": 20,
    "eval_every_steps": 40,
    "checkpoint_every_steps": 20,
    "eval_at_start": False,
    "data.num_eval_rows": 32,
    "optimizer.warmup_steps": 5,
    # The rate of a step does not depend on num_train_steps: a run of 20 steps resumed
    # to 40 trains what a run of 40 does.
    "optimizer.schedule": "constant",
}


def tiny_lm(data_dir, **overrides):
    config = llama.get_config("tiny")
    config.data.data_dir = data_dir
    config.update_from_flattened_dict({**STEPS, **overrides})
    return config


def rows(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def losses(workdir):
    return {r["step"]: r["loss"] for r in rows(workdir) if "loss" in r}


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """A 40-step wus run of the tiny decoder in float32: 20 steps, then resumed to 40."""
    workdir = str(tmp_path_factory.mktemp("lm"))
    f32 = {"model.dtype": "float32"}
    train_lib.train(tiny_lm(data_dir, num_train_steps=20, **f32), workdir)
    train_lib.train(tiny_lm(data_dir, **f32), workdir)
    return workdir


@pytest.mark.slow  # two more training runs: ~30 s, cold (per_layer against wus stays)
@pytest.mark.parametrize("mode", ["none", "fsdp"])
def test_every_update_mode_trains_the_numbers_of_the_others(run, data_dir, tmp_path, mode):
    # The run's wus losses, in float32 (bf16 rounds the gathered weights alike in every
    # mode, but float32 shows the sums in another order too).
    config = tiny_lm(data_dir, **{"model.dtype": "float32", "optimizer.update_sharding": mode})
    train_lib.train(config, str(tmp_path))
    want, got = losses(run), losses(tmp_path)
    assert sorted(got) == sorted(want) == [20, 40]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


def test_per_layer_gathering_trains_the_numbers_of_wus_and_shares_its_checkpoints(
    run, data_dir, tmp_path
):
    # 20 steps gathering each layer inside the scan, then 20 more as wus from its
    # checkpoint: the losses of the wus run, which gathered its stacks whole.
    f32 = {"model.dtype": "float32"}
    per_layer = {**f32, "optimizer.update_sharding": "per_layer"}
    train_lib.train(tiny_lm(data_dir, num_train_steps=20, **per_layer), str(tmp_path))
    train_lib.train(tiny_lm(data_dir, **f32), str(tmp_path))
    want, got = losses(run), losses(tmp_path)
    assert sorted(got) == sorted(want) == [20, 40]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-5), step


@pytest.mark.parametrize(
    "mode",
    [
        "per_layer",  # the kernel inside the replicas' shard_map, the model axis left auto
        pytest.param("wus", marks=pytest.mark.slow),  # every axis auto, in the replicas' vmap
    ],
)
def test_flash_attention_with_split_heads_trains_the_numbers_of_dot_attention(
    data_dir, tmp_path, mode
):
    # The Pallas TPU flash kernel, run on this CPU by Pallas's interpreter (True: its
    # jit of a scan over the kernel's grid; the TPU interpreter's simulated memory
    # works by callbacks with effects, which flax's scan refuses), under tensor
    # parallelism: 4 replicas x 2 ways of heads. A kernel cannot be split by XLA, so
    # each device runs it on its 2 of the 4 query heads and their key heads; were a
    # query head paired with another's key head, or a device's rows or heads not its
    # own, the losses would differ. Rows of 128 tokens: the kernel's smallest block.
    from jax.experimental.pallas import tpu as pltpu  # noqa: PLC0415

    def losses_of(attention):
        config = tiny_lm(
            data_dir,
            num_train_steps=4,
            steps_per_loop=2,
            log_every_steps=2,
            eval_every_steps=0,
            checkpoint_every_steps=0,
            **{
                "model.dtype": "float32",
                "model.attention": attention,
                "data.max_length": 128,
                "optimizer.update_sharding": mode,
                "mesh.axes.data": 4,
                "mesh.axes.model": 2,
            },
        )
        with pltpu.force_tpu_interpret_mode(True):
            train_lib.train(config, str(tmp_path / attention))
        return losses(tmp_path / attention)

    want, got = losses_of("dot"), losses_of("flash")
    assert sorted(got) == sorted(want) == [2, 4]
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6), step


def test_a_resume_is_bit_exact(run, data_dir, tmp_path):
    train_lib.train(tiny_lm(data_dir, **{"model.dtype": "float32"}), str(tmp_path))
    uninterrupted, resumed = rows(tmp_path), rows(run)
    for a, b in zip(uninterrupted, resumed, strict=True):
        for key in ("loss", "grad_norm", "param_norm", "accuracy"):
            assert a[key] == b[key], key
    for key in ("eval/nll", "eval/accuracy"):  # the last evaluation, at step 40
        assert uninterrupted[-1][key] == resumed[-1][key], key


@pytest.mark.slow  # two evaluate processes
def test_evaluation_does_not_depend_on_the_device_count(run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(run, workdir)
    for devices in (1, 8):
        command = [sys.executable, "-m", "trainer.evaluate", "--workdir", workdir]
        result = run_command([*command, f"--cpu_devices={devices}"])
        assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(workdir, "eval.jsonl")) as f:
        one, eight = (json.loads(line) for line in f)
    logged = rows(run)[-1]
    for key in ("eval/loss", "eval/accuracy", "eval/perplexity"):
        assert one[key] == pytest.approx(eight[key], rel=1e-5), key
        assert eight[key] == pytest.approx(logged[key], rel=1e-5), key
    assert logged["eval/perplexity"] == pytest.approx(np.exp(logged["eval/nll"]))


def test_the_generator_continues_prompts_as_the_command_does(run):
    from trainer import Generator

    model = Generator.load(run)
    assert model.step == 40
    prompts = ["every ship holds your dark chair =>", "the dog =>", ""]
    greedy = model.generate(prompts, max_new_tokens=12, batch_size=2)
    assert len(greedy) == 3 and all(isinstance(g, str) for g in greedy)
    # One prompt alone, or in a batch of others: the same continuation.
    assert model.generate(prompts[1:2], max_new_tokens=12) == greedy[1:2]
    sampled = dict(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=4)
    assert model.generate(prompts, **sampled) == model.generate(prompts, **sampled)
    # The same seed gives the same samples on one device as on eight.
    config = model.config.copy_and_resolve_references()
    config.mesh.num_devices = 1
    alone = Generator.load(run, config=config)
    assert alone.generate(prompts, **sampled) == model.generate(prompts, **sampled)
    # The command line: one line out per line in, the same greedy text.
    command = [sys.executable, "-m", "trainer.generate", "--workdir", run, "--cpu_devices=8"]
    result = run_command([*command, "--max_new_tokens=12"], stdin="\n".join(prompts) + "\n")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:3] == [" ".join(g.split()) for g in greedy]
    assert "tokens/s" in result.stderr.splitlines()[-1]
    with pytest.raises(
        UserError,
        match=r"prompt 0 has \d+ tokens: with max_new_tokens=120 .* "
        r"model.max_len=128",
    ):
        model.generate(prompts[:1], max_new_tokens=120)
    with pytest.raises(UserError, match="prompts: give a list of strings, not one str"):
        model.generate("one prompt")


def test_the_batches_a_run_consumed_are_one_command_away(run, tmp_path):
    command = [sys.executable, "-m", "trainer.data.batches", f"--workdir={run}"]
    printed = run_command([*command, "--steps=39:40", "--decode"])
    assert printed.returncode == 0, printed.stderr[-3000:]
    lines = [json.loads(line) for line in printed.stdout.splitlines()]
    assert [(r["step"], r["row"]) for r in lines] == [(s, r) for s in (39, 40) for r in range(32)]
    for r in lines:
        inputs, targets, segments = (np.array(r[k]) for k in ("inputs", "targets", "segmentation"))
        weights, positions = np.array(r["weights"]), np.array(r["positions"])
        assert inputs.shape == targets.shape == (64,)
        # Each token's target is the next token, weighed only inside its own document,
        # whose positions count from 0.
        np.testing.assert_array_equal(inputs[1:], targets[:-1])
        same = (segments[:-1] == segments[1:]) & (segments[:-1] > 0)
        np.testing.assert_array_equal(weights[:-1][~same], 0)
        for segment in set(segments[segments > 0].tolist()):
            np.testing.assert_array_equal(
                positions[segments == segment], range((segments == segment).sum())
            )
        assert r["text"] and all(isinstance(t, str) for t in r["text"])
    written = run_command([*command, "--steps=39:40", f"--out={tmp_path / 'b.npz'}"])
    assert written.returncode == 0, written.stderr[-3000:]
    arrays = np.load(tmp_path / "b.npz")
    np.testing.assert_array_equal(arrays["steps"], [39, 40])
    np.testing.assert_array_equal(arrays["inputs"][1, 5], lines[32 + 5]["inputs"])
    wrong = run_command([*command, "--steps=0:3"])
    assert wrong.returncode != 0 and wrong.stderr.strip().splitlines()[-1].startswith("error:")


@pytest.mark.slow
def test_the_tiny_decoder_learns_as_a_user_runs_it(tmp_path):
    command = [sys.executable, "-m", "trainer", "--config=configs/llama.py:tiny"]
    result = run_command(
        [
            *command,
            f"--workdir={tmp_path}",
            "--cpu_devices=8",
            f"--config.data.data_dir={tmp_path / 'tfds'}",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    evals = [r for r in rows(tmp_path) if "eval/perplexity" in r]
    assert [r["step"] for r in evals] == [0, 200, 400]
    assert evals[0]["eval/perplexity"] > 5 * evals[-1]["eval/perplexity"]


@pytest.mark.slow
def test_the_tiny_bert_learns_as_a_user_runs_it(tmp_path):
    config = bert_large.get_config("tiny")
    config.data.data_dir = str(tmp_path / "tfds")
    config.compiler_options = RUNS_LONG  # 300 steps
    train_lib.train(config, str(tmp_path / "run"))
    evals = [r for r in rows(tmp_path / "run") if "eval/accuracy" in r]
    assert evals[0]["step"] == 0 and evals[-1]["step"] == 300
    assert evals[-1]["eval/accuracy"] > 3 * evals[0]["eval/accuracy"]
