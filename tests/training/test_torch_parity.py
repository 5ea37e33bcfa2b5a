"""Training equals PyTorch's, step by step: a Llama and a Qwen2 made by ``transformers``,
imported and trained 40 steps with AdamW by the command line on ``text_files`` under
every update-sharding mode, against the same 40 batches through ``torch.optim.AdamW``.

The reference shares nothing with the trainer but the batches, which it reads with
the documented command (``python -m trainer.data.batches``). It runs each packed
document of a row on its own, at the positions the row gives it (so no document sees
another), sums the cross entropy of the targets the row weighs, divides by the step's
total weight, clips the global gradient norm at 1.0 (optax's formula), and decays
weights as docs/configs.md says: every parameter but norm scales and biases. The
learning rate of step ``s`` (0-based) is written out here: linear warm-up from 0 over
5 steps, then a cosine to a tenth of the peak.

Both sides run in float32 (``model.dtype`` and ``optimizer.gather_dtype``), where the
order of the sums is all that differs: per-step losses agree to 1e-6 relative, final
weights to 1e-5.
"""

import json
import math
import os
import sys

import numpy as np
import pytest
from conftest import REPO, run_command

pytestmark = pytest.mark.slow  # 8 training runs, their exports and the reference: minutes

STEPS, PEAK, WARMUP, WEIGHT_DECAY = 40, 2e-3, 5, 0.1
MODES = ("none", "wus", "fsdp", "per_layer")
MODELS = {
    # Random norm scales and biases (scripts/make_hf_model.py), so their decay would show.
    "llama": dict(architecture="llama", layers=3, hidden=128, heads=4, kv_heads=2),
    "qwen2": dict(architecture="qwen2", layers=2, hidden=64, heads=4, kv_heads=2, tie=True),
}


def learning_rate(count: int) -> float:
    if count < WARMUP:
        return PEAK * count / WARMUP
    t, span, end = count - WARMUP, STEPS - WARMUP, 0.1
    return PEAK * (end + (1 - end) * 0.5 * (1 + math.cos(math.pi * min(t, span) / span)))


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    pytest.importorskip("transformers")
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import make_hf_model

    out = {}
    for name, settings in MODELS.items():
        directory = str(tmp_path_factory.mktemp(name))
        make_hf_model.make_model(directory, vocab_size=512, **settings)
        out[name] = directory
    return out


def train(model_dir, workdir, mode):
    flags = {
        "data.name": "text_files",
        "data.train_files": os.path.join(REPO, "examples", "text", "train", "*"),
        "data.eval_files": os.path.join(REPO, "examples", "text", "eval.jsonl"),
        "data.max_length": 32,
        "data.worker_count": 0,
        "global_batch_size": 16,
        "num_train_steps": STEPS,
        "steps_per_loop": 1,
        "log_every_steps": 1,
        "eval_every_steps": 0,
        "eval_at_start": False,
        "checkpoint_every_steps": 0,
        "model.dtype": "float32",
        "optimizer.gather_dtype": "float32",
        "optimizer.update_sharding": mode,
        "optimizer.min_shard_bytes": 0,
        "optimizer.name": "adamw",
        "optimizer.b1": 0.9,
        "optimizer.b2": 0.95,
        "optimizer.eps": 1e-5,
        "optimizer.learning_rate": PEAK,
        "optimizer.end_learning_rate": PEAK / 10,
        "optimizer.schedule": "cosine",
        "optimizer.warmup_steps": WARMUP,
        "optimizer.weight_decay": WEIGHT_DECAY,
        "optimizer.clip_norm": 1.0,
    }
    command = [
        sys.executable,
        "-m",
        "trainer",
        f"--config=configs/llama.py:hf={model_dir}",
        f"--workdir={workdir}",
        "--cpu_devices=8",
        *(f"--config.{k}={v}" for k, v in flags.items()),
    ]
    result = run_command(command, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return np.array([r["loss"] for r in rows if "loss" in r])


def export(workdir, out):
    command = [sys.executable, "-m", "trainer.export", f"--workdir={workdir}"]
    result = run_command([*command, "--format=hf", f"--out={out}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    from safetensors.numpy import load_file

    tensors = {}
    for name in sorted(os.listdir(out)):
        if name.endswith(".safetensors"):
            tensors |= load_file(os.path.join(out, name))
    return tensors


def batches_of(workdir, out):
    command = [sys.executable, "-m", "trainer.data.batches", f"--workdir={workdir}"]
    result = run_command([*command, f"--steps=1:{STEPS}", f"--out={out}"], timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(out))


def torch_reference(model_dir, batches):
    """(per-step losses, final weights) of the same steps in PyTorch."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.train()
    named = dict(model.named_parameters())
    no_decay = [p for n, p in named.items() if "norm" in n or n.endswith(".bias")]
    decay = [p for n, p in named.items() if not ("norm" in n or n.endswith(".bias"))]
    assert no_decay and decay
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0}],
        lr=0.0,
        betas=(0.9, 0.95),
        eps=1e-5,
    )
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        total_weight = float(batches["weights"][step].sum())
        total = 0.0
        for row in range(batches["inputs"].shape[1]):
            segments = batches["segmentation"][step, row]
            for segment in np.unique(segments[segments > 0]):
                at = segments == segment
                ids = torch.tensor(batches["inputs"][step, row][at], dtype=torch.long)[None]
                positions = torch.tensor(batches["positions"][step, row][at])[None]
                targets = torch.tensor(batches["targets"][step, row][at], dtype=torch.long)
                weights = torch.tensor(batches["weights"][step, row][at], dtype=torch.float32)
                logits = model(input_ids=ids, position_ids=positions).logits[0]
                nll = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
                loss = (nll * weights).sum() / total_weight
                loss.backward()
                total += float(loss.detach())
        losses.append(total)
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))
        if norm > 1.0:  # optax.clip_by_global_norm: g * max_norm / norm (no epsilon)
            for p in model.parameters():
                p.grad.mul_(float(1.0 / norm))
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step)
        optimizer.step()
    weights = {n: p.detach().numpy().copy() for n, p in model.state_dict().items()}
    return np.array(losses), weights


@pytest.mark.parametrize("name", sorted(MODELS))
def test_training_equals_pytorch_adamw_step_by_step(name, hf_models, tmp_path):
    model_dir = hf_models[name]
    runs = {mode: str(tmp_path / mode) for mode in MODES}
    losses = {mode: train(model_dir, workdir, mode) for mode, workdir in runs.items()}
    batches = batches_of(runs["wus"], str(tmp_path / "batches.npz"))
    assert batches["inputs"].shape == (STEPS, 16, 32)
    assert (batches["segmentation"].max(axis=-1) > 1).any(), "rows pack several documents"
    want_losses, want_weights = torch_reference(model_dir, batches)
    report = {}
    for mode, workdir in runs.items():
        got = losses[mode]
        assert got.shape == (STEPS,)
        np.testing.assert_allclose(got, want_losses, rtol=1e-6, err_msg=f"{name} {mode} losses")
        final = export(workdir, str(tmp_path / f"{mode}_hf"))
        worst = 0.0
        for key, value in want_weights.items():
            if key not in final:  # a tied output table is the input table
                assert key == "lm_head.weight", key
                continue
            np.testing.assert_allclose(final[key], value, rtol=0, atol=1e-5, err_msg=key)
            worst = max(worst, float(np.abs(final[key] - value).max()))
        report[mode] = (float(np.max(np.abs(got / want_losses - 1))), worst)
    # The weights did move, by far more than the tolerance.
    before = export_free_weights(model_dir)
    moved = max(float(np.abs(want_weights[k] - before[k]).max()) for k in before)
    assert moved > 1e-2, moved
    print(f"{name}: worst relative loss gap and weight gap per mode: {report}")


def export_free_weights(model_dir):
    from safetensors.numpy import load_file

    tensors = {}
    for n in os.listdir(model_dir):
        if n.endswith(".safetensors"):
            tensors |= load_file(os.path.join(model_dir, n))
    return tensors
