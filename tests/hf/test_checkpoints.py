"""Hugging Face checkpoints in and out, against code no one here wrote: random models
made and saved by ``transformers`` itself (scripts/make_hf_model.py), their logits from
``transformers``' forward pass in PyTorch, and ``transformers`` loading our exports."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, run_command
from flax import linen as nn
from flax import traverse_util
from safetensors.numpy import load_file

from configs import llama
from models import stacking
from trainer.errors import ConfigError
from trainer.hf import config as hf_config_lib
from trainer.hf import names
from trainer.inference import hf_export
from trainer.input import tokenizer as tokenizer_lib
from trainer.training import experiment as experiment_lib
from trainer.training import init_from
from trainer.training import train as train_lib

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_hf_model  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BOUND = 1e-4  # max |logit difference| in float32
TEXT = "every ship holds your dark chair => the dog sees 42 ships, naïvely."

# Models that stress the mapping: one kv head and as many as the heads, tied and untied
# tables, Llama 3.1's RoPE scaling, a head dim that is not hidden / heads, a sliding
# window shorter than the ids, q/k/v biases.
MODELS = {
    "llama": dict(architecture="llama", kv_heads=2),
    "llama-mqa-tied-rope3": dict(architecture="llama", kv_heads=1, tie=True, llama3_scaling=True),
    "llama-mha-head24": dict(architecture="llama", kv_heads=4, head_dim=24),
    "mistral-window": dict(architecture="mistral", kv_heads=2, sliding_window=12),
    "qwen2": dict(architecture="qwen2", kv_heads=2, tie=True),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """name -> (directory, the transformers model in float32)."""
    root = tmp_path_factory.mktemp("hf")
    return {
        name: (str(root / name), make_hf_model.make_model(str(root / name), **kind))
        for name, kind in MODELS.items()
    }


def ids_for(vocab_size, rows=8, length=40):
    return np.random.default_rng(0).integers(0, vocab_size, size=(rows, length)).astype(np.int32)


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def hf_config(directory, **overrides):
    """``configs/llama.py:hf=DIR`` in float32, as the command line builds it."""
    config = llama.get_config(f"hf={directory}")
    config.update_from_flattened_dict({"model.dtype": "float32", **overrides})
    return config


def imported(config):
    """``(experiment, logical params)`` of a run starting from its ``init_from``."""
    exp = experiment_lib.build(config, with_data=False)
    state = init_from.initial_state(exp, log=lambda _: None)
    return exp, exp.params_to_logical(state.params)


def logits(exp, params, ids):
    model = exp.model
    with jax.set_mesh(model.mesh), nn.logical_axis_rules(model.rules):
        return np.asarray(model.task.model.apply({"params": params}, ids))


def assert_same_logits(got, want):
    assert got.shape == want.shape
    worst = float(np.abs(got - want).max())
    assert worst <= BOUND, worst
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))
    return worst


@pytest.mark.parametrize("name", list(MODELS))
def test_imported_models_compute_the_logits_of_transformers(made, name):
    directory, reference = made[name]
    config = hf_config(directory)
    ids = ids_for(config.model.vocab_size)
    exp, params = imported(config)
    assert_same_logits(logits(exp, params, ids), reference_logits(reference, ids))


def test_imports_place_into_every_layout_alike(made):
    # Layers stacked or one module per layer, update sharding wus, fsdp or none: the
    # same parameters (the import writes each device's block of the stored layout).
    directory, _ = made["qwen2"]
    _, want = imported(hf_config(directory))
    for overrides in (
        {"model.scan_layers": False},
        {"optimizer.update_sharding": "none"},
        {"optimizer.update_sharding": "fsdp"},
    ):
        _, got = imported(hf_config(directory, **overrides))
        got = traverse_util.flatten_dict(got, sep="/")
        for name, value in traverse_util.flatten_dict(want, sep="/").items():
            if name in got:
                np.testing.assert_array_equal(got[name], value, err_msg=f"{overrides} {name}")
            else:  # the stack's layer i is layers_i
                top, _, rest = name.partition("/")
                for i, layer in enumerate(np.asarray(value)):
                    np.testing.assert_array_equal(got[f"{top}_{i}/{rest}"], layer)


def test_tokenization_equals_auto_tokenizers(made):
    directory, _ = made["llama"]
    ours = tokenizer_lib.load_text_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    assert ours.encode(TEXT) == theirs.encode(TEXT, add_special_tokens=False)
    assert ours.bos_id == theirs.bos_token_id and ours.eos_id == theirs.eos_token_id


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    """Our tiny decoder (SentencePiece tokenizer, tied tables), 20 wus steps in float32."""
    workdir = str(tmp_path_factory.mktemp("tiny"))
    config = llama.get_config("tiny")
    config.data.data_dir = data_dir
    config.update_from_flattened_dict(
        {"num_train_steps": 20, "eval_at_start": False, "model.dtype": "float32"}
    )
    train_lib.train(config, workdir)
    return workdir


def test_an_export_loads_in_transformers_with_our_logits_and_tokens(trained, tmp_path):
    out = tmp_path / "hf"
    command = [sys.executable, "-m", "trainer.export", f"--workdir={trained}", "--format=hf"]
    result = run_command([*command, f"--out={out}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "exported step 20 as LlamaForCausalLM" in result.stdout
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert all(not keys for keys in info.values()), info  # nothing missing or unexpected
    from trainer import Generator

    ours = Generator.load(trained)
    ids = ids_for(ours.config.model.vocab_size, length=64)
    exp = ours._trained
    assert_same_logits(logits(exp, exp.params, ids), reference_logits(model.float().eval(), ids))
    # Their tokenizer is our SentencePiece model, id for id, BOS included.
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.tokenizer.encode(TEXT)
    assert theirs.encode(TEXT)[0] == ours.tokenizer.bos_id
    # Decoding too, where every character is a piece (SentencePiece spells an unknown
    # piece " ⁇ ", the tokenizers library "<unk>").
    known = ours.tokenizer.encode("every ship holds your dark chair => the dog")
    assert theirs.decode(known, skip_special_tokens=True) == ours.tokenizer.decode(known)
    settings = json.loads((out / "generation_config.json").read_text())
    assert settings["eos_token_id"] == ours.tokenizer.eos_id


def test_import_export_import_is_bit_identical(made, tmp_path):
    # A run of one step at learning rate 0 keeps the imported parameters as they came.
    directory, _ = made["qwen2"]
    config = hf_config(
        directory,
        **{
            "num_train_steps": 1,
            "optimizer.learning_rate": 0.0,
            "optimizer.end_learning_rate": 0.0,
            "global_batch_size": 8,
            "data.max_length": 32,
            "data.train_files": os.path.join(REPO, "examples", "text", "train", "part-0.txt"),
            "data.eval_files": os.path.join(REPO, "examples", "text", "eval.jsonl"),
        },
    )
    train_lib.train(config, str(tmp_path / "run"))
    done = hf_export.export(tmp_path / "run", tmp_path / "out", max_shard_bytes=40_000)
    assert done.shards > 1 and done.architecture == "Qwen2ForCausalLM"
    original = load_file(os.path.join(directory, "model.safetensors"))
    exported = {}
    for name in set(
        json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())[
            "weight_map"
        ].values()
    ):
        exported |= load_file(tmp_path / "out" / name)
    assert sorted(exported) == sorted(k for k in original if k != "lm_head.weight")  # tied
    for name, value in original.items():
        if name in exported:
            assert exported[name].dtype == value.dtype
            np.testing.assert_array_equal(exported[name], value, err_msg=name)
    _, first = imported(hf_config(directory))
    _, again = imported(hf_config(str(tmp_path / "out")))
    first, again = (jax.tree_util.tree_leaves_with_path(p) for p in (first, again))
    for (path, a), (_, b) in zip(first, again, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def test_a_model_of_another_size_than_the_run_is_refused(made):
    directory, _ = made["llama"]
    config = hf_config(directory, **{"model.num_layers": 3})
    with pytest.raises(
        ConfigError, match=r"num_hidden_layers=2 but this run has model.num_layers=3"
    ):
        imported(config)


@pytest.mark.parametrize("size", ["llama3-8b", "llama3-70b"])
def test_the_name_map_covers_the_large_models_without_their_bytes(tmp_path, size):
    # Our config.json of the size, read back by transformers onto the meta device (no
    # bytes): every tensor it builds is one of ours, of the shape our map says, and our
    # config read back from it is the same model.
    model = llama.get_config(size).model
    settings = hf_config_lib.hf_config(model, bos_id=1, eos_id=2, dtype="bfloat16")
    (tmp_path / "config.json").write_text(json.dumps(settings))
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path)
        )
    shapes = {name: tuple(p.shape) for name, p in theirs.state_dict().items()}
    if model.tie_embeddings:
        shapes.pop("lm_head.weight")
    mapped = names.per_layer(model)
    assert {t.name: t.shape for t in mapped.values()} == shapes
    # Each of our parameters, stacked as the run stores them, comes from the map.
    abstract = experiment_lib.build_model(llama.get_config(size), with_data=False).abstract_params
    ours = traverse_util.flatten_dict(abstract, sep="/")
    given = {n: jax.ShapeDtypeStruct(t.ours, np.float32) for n, t in mapped.items()}
    assert sorted(stacking.match(ours, given)) == sorted(ours)
    for key, value in hf_config_lib.read_model_keys(tmp_path).items():
        if key != "name":
            assert model[key] == value, key
