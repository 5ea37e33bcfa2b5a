"""The language-model user's path without surprises: a Hugging Face directory is taken
wherever a run's is, its special tokens and stop ids as ``transformers`` takes them,
exports refuse before they write and leave nothing half-written, and each damaged
input or wrong argument is one :class:`~trainer.errors.UserError` naming it (the
command-line forms: tests/command/test_cli_errors.py).

The models are random ones ``transformers`` makes and saves (scripts/make_hf_model.py);
the run is our tiny decoder trained for one step."""

import json
import os
import re
import shutil
import sys

import numpy as np
import pytest
from conftest import REPO, run_command

from configs import llama, transformer_1024
from trainer import Generator
from trainer.errors import ConfigError, UserError
from trainer.hf import config as hf_config
from trainer.hf import safetensors_files
from trainer.inference import export as export_lib
from trainer.inference import hf_export, translator
from trainer.input import tokenizer as tokenizer_lib
from trainer.training import train as train_lib
from trainer.workdir import storage

sys.path.insert(0, os.path.join(REPO, "scripts"))
import make_hf_model  # noqa: E402

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

PROMPT = "every ship holds your dark chair =>"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """``(directory, transformers' model)``: a random Llama in one safetensors file."""
    directory = str(tmp_path_factory.mktemp("hf") / "llama")
    return directory, make_hf_model.make_model(directory, kv_heads=2)


def copy(model, tmp_path, name="copy") -> str:
    out = str(tmp_path / name)
    shutil.copytree(model[0], out)
    return out


def edit_json(path: str, remove: tuple[str, ...] = (), **fields) -> None:
    """``path``'s JSON object with ``fields`` set and the keys ``remove`` removed."""
    with open(path) as f:
        content = json.load(f) | fields
    with open(path, "w") as f:
        json.dump({k: v for k, v in content.items() if k not in remove}, f)


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """Our tiny decoder (a unigram SentencePiece model trained on its corpus), one step."""
    workdir = str(tmp_path_factory.mktemp("run"))
    config = llama.get_config("tiny")
    config.data.data_dir = data_dir
    config.update_from_flattened_dict(
        {
            "num_train_steps": 1,
            "steps_per_loop": 1,
            "eval_at_start": False,
            "eval_every_steps": 0,
            "model.dtype": "float32",
        }
    )
    train_lib.train(config, workdir)
    return workdir


# ------------------------------------------------------------- silently wrong


def test_a_safetensors_file_cut_short_is_refused_not_read_as_zeros(model, tmp_path):
    directory = copy(model, tmp_path)
    file = os.path.join(directory, "model.safetensors")
    with open(file, "rb") as f:
        data = f.read()
    with open(file, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=rf"{re.escape(file)} is cut short: .* \(download it"):
        safetensors_files.Reader(directory)
    with pytest.raises(ConfigError, match="is cut short"):
        Generator.load(directory)


def test_a_weight_of_integers_is_refused(model, tmp_path):
    from safetensors.numpy import load_file, save_file

    directory = copy(model, tmp_path)
    file = os.path.join(directory, "model.safetensors")
    tensors = load_file(file)
    tensors["model.norm.weight"] = np.ones_like(tensors["model.norm.weight"], np.int32)
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(
        ConfigError,
        match=r"tensor model.norm.weight in model.safetensors is int32: a weight is "
        r"floating-point",
    ):
        Generator.load(directory)


def test_an_export_inside_the_checkpoints_directory_is_refused(run):
    out = os.path.join(run, "checkpoints", "export")
    for write in (export_lib.export, hf_export.export):
        with pytest.raises(ConfigError, match=r"is inside the run's checkpoints directory"):
            write(run, out)
    assert not os.path.exists(out)


# ---------------------------------------------- what transformers does, we do


@pytest.mark.parametrize(
    "case",
    [
        # transformers follows the post-processor, whatever tokenizer_config.json names:
        "bos_token named, the post-processor adds none",
        "the post-processor adds BOS, no bos_token named",
        "no tokenizer_config.json",
    ],
)
def test_bos_is_what_the_post_processor_adds_as_transformers_takes_it(model, tmp_path, case):
    directory = copy(model, tmp_path)
    if case.startswith("bos_token named"):
        edit_json(os.path.join(directory, "tokenizer.json"), post_processor=None)
        with open(os.path.join(directory, "tokenizer.json")) as f:
            assert json.load(f)["post_processor"] is None
    elif case.startswith("the post-processor adds BOS"):
        edit_json(os.path.join(directory, "tokenizer_config.json"), remove=("bos_token",))
    else:
        os.remove(os.path.join(directory, "tokenizer_config.json"))
    ours = tokenizer_lib.load_text_tokenizer(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(directory)
    bos = [] if ours.bos_id is None else [ours.bos_id]
    assert bos + ours.encode(PROMPT) == theirs(PROMPT).input_ids


def test_generation_stops_at_any_eos_of_generation_config_as_transformers_does(model, tmp_path):
    # Llama 3 Instruct's generation_config.json lists three EOS ids. Here: the token
    # transformers' greedy continuation gives 4th, between two it never gives.
    directory = copy(model, tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    reference = model[1].float().eval()
    free = reference.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    free = free[0, ids.shape[1] :].tolist()
    fourth = free[3]
    assert fourth not in free[:3], free
    unused = [i for i in range(2, 300) if i not in free][:2]
    edit_json(
        os.path.join(directory, "generation_config.json"),
        eos_token_id=[unused[0], fourth, unused[1]],
    )
    settings = transformers.GenerationConfig.from_pretrained(directory)
    stopped = reference.generate(ids, generation_config=settings, max_new_tokens=12)
    stopped = stopped[0, ids.shape[1] :].tolist()
    assert stopped == free[:4]  # transformers stops after 4 tokens, the 4th an EOS
    ours = Generator.load(directory)
    assert ours.tokenizer.stop_ids == (unused[0], fourth, unused[1])
    (text,) = ours.generate([PROMPT], max_new_tokens=12)
    assert text == tokenizer.decode(free[:3], skip_special_tokens=True)


def test_an_export_names_pad_and_rope_theta_as_older_readers_read_them(run, tmp_path):
    done = hf_export.export(run, tmp_path / "hf")
    assert done.step == 1
    with open(tmp_path / "hf" / "config.json") as f:
        config = json.load(f)
    ours = Generator.load(run).tokenizer
    assert config["pad_token_id"] == ours.pad_id == 0  # the tokenizer's <pad>
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] == 10_000.0
    with open(tmp_path / "hf" / "generation_config.json") as f:
        generation = json.load(f)
    assert generation["eos_token_id"] == ours.eos_id and generation["pad_token_id"] == 0
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.pad_token_id == config["pad_token_id"]
    # Llama 3.1's scaling, for readers that know rope_scaling only.
    model = llama.get_config("llama3.2-1b").model
    written = hf_config.hf_config(model, bos_id=1, eos_id=2, pad_id=None, dtype="bfloat16")
    assert written["rope_scaling"]["rope_type"] == "llama3"
    assert written["rope_scaling"]["factor"] == 32.0 and written["rope_theta"] == 500_000.0


# ------------------------------- a Hugging Face directory where a run is taken


def test_hugging_face_directories_are_taken_where_a_run_is(model, tmp_path):
    directory = model[0]
    generator = Generator.load(directory)
    assert generator.step is None and generator.config.init_from == directory
    want = generator.generate([PROMPT], max_new_tokens=6)
    step, _ = export_lib.export(directory, tmp_path / "orbax")
    assert step is None
    assert Generator.load(tmp_path / "orbax").generate([PROMPT], max_new_tokens=6) == want


@pytest.mark.slow  # three commands, a model compiled in each: ~40 s
def test_the_commands_take_a_hugging_face_directory(model, tmp_path):
    directory = model[0]
    command = [sys.executable, "-m"]
    generated = run_command(
        [*command, "trainer.generate", f"--workdir={directory}", "--max_new_tokens=6"],
        stdin=PROMPT + "\n",
    )
    assert generated.returncode == 0, generated.stderr[-3000:]
    (want,) = Generator.load(directory).generate([PROMPT], max_new_tokens=6)
    assert generated.stdout == " ".join(want.splitlines()) + "\n"
    assert f"for 1 prompt with the parameters of {directory}, greedy" in generated.stderr
    evaluated = run_command(
        [
            *command,
            "trainer.evaluate",
            f"--workdir={directory}",
            "--cpu_devices=8",
            f"--config.data.eval_files={REPO}/examples/text/eval.jsonl",
            "--config.data.max_length=64",
            "--config.global_batch_size=16",
        ]
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    (line,) = evaluated.stdout.splitlines()
    assert line.startswith(f"{directory} | eval/accuracy ") and "| eval/perplexity " in line
    # The samples it computed (greedy continuations of held-out documents) are said.
    assert evaluated.stderr.count("  sample: ") == 3, evaluated.stderr[-3000:]
    assert not os.path.exists(os.path.join(directory, "eval.jsonl"))
    out = tmp_path / "bf16"
    exported = run_command(
        [*command, "trainer.export", f"--workdir={directory}", "--format=hf", f"--out={out}"]
        + ["--dtype=bfloat16"]
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert f"exported {directory} as LlamaForCausalLM to {out}" in exported.stdout
    assert transformers.AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


@pytest.mark.slow  # three models compiled: ~20 s
def test_our_own_hugging_face_export_is_taken_where_a_run_is(run, tmp_path):
    ours = tmp_path / "ours"
    hf_export.export(run, ours)
    continued = Generator.load(run).generate([PROMPT], max_new_tokens=6)
    assert Generator.load(ours).generate([PROMPT], max_new_tokens=6) == continued
    again = hf_export.export(ours, tmp_path / "again", dtype="bfloat16")
    assert again.step is None and again.architecture == "LlamaForCausalLM"
    # The bf16 export of the import is the f32 export rounded, tensor for tensor, as
    # safetensors' own reader reads both.
    from safetensors.torch import load_file

    def tensors(directory):
        files = sorted(directory.glob("*.safetensors"))
        return {k: v for f in files for k, v in load_file(f).items()}

    f32, bf16 = tensors(ours), tensors(tmp_path / "again")
    assert sorted(f32) == sorted(bf16)
    assert all(torch.equal(f32[k].to(torch.bfloat16), bf16[k]) for k in f32)


# ------------------------------------------------ exports leave nothing behind


def test_an_export_refuses_a_bpe_sentencepiece_model_before_writing(run, tmp_path):
    import sentencepiece as spm

    workdir = str(tmp_path / "bpe_run")
    shutil.copytree(run, workdir)
    with open(os.path.join(REPO, "examples", "text", "train", "part-0.txt")) as f:
        lines = f.read().splitlines()[:2000]
    bpe = tmp_path / "bpe.model"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_prefix=str(bpe)[: -len(".model")],
        vocab_size=300,
        model_type="bpe",
        minloglevel=2,
    )
    shutil.copy(bpe, os.path.join(workdir, tokenizer_lib.SPM_FILE))
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"is a SentencePiece BPE model, .* nothing was written"):
        hf_export.export(workdir, out)
    assert sorted(os.listdir(tmp_path)) == ["bpe.model", "bpe.vocab", "bpe_run"]


def test_a_full_disk_during_an_export_leaves_nothing_and_names_the_path(run, tmp_path, monkeypatch):
    from trainer import faults

    monkeypatch.setenv("WUS_FAULT", "export:enospc")
    for write, name in ((hf_export.export, "hf"), (export_lib.export, "orbax")):
        monkeypatch.setattr(
            faults, "_passes", {}
        )  # the first pass of this export, not the module's
        out = tmp_path / name
        with pytest.raises(
            storage.PathError,
            match=rf"^--out {out}: No space left on device .*: free some space or choose "
            r"another disk \(nothing was left there\)$",
        ):
            write(run, out)
        assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


# --------------------------------------------------------- arguments, checked


@pytest.fixture(scope="module")
def generator(model):
    return Generator.load(model[0])


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"max_new_tokens": 4.5}, r"max_new_tokens=4.5 is float: give an int of at least 1"),
        ({"max_new_tokens": "4"}, r"max_new_tokens='4' is str: give an int of at least 1"),
        (
            {"max_new_tokens": 100000},
            r"max_new_tokens=100000 leaves no room for a prompt in the model's context, "
            r"model.max_len=128: give at most 127",
        ),
        ({"temperature": "hot"}, r"temperature='hot' is str: give a number 0 \(greedy\) or more"),
        ({"temperature": float("nan")}, r"temperature=nan is not a finite number"),
        ({"top_k": 2.5}, r"top_k=2.5 is float: give an int of at least 0"),
        ({"top_k": 513}, r"top_k=513 is more than the model's 512 ids: give at most 512"),
        ({"seed": 2**70}, r"seed=1180591620717411303424 is too large: give one below 2\*\*32"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"batch_size": True}, r"batch_size=True is bool: give an int of at least 1"),
    ],
)
def test_generation_arguments_are_checked(generator, arguments, message):
    with pytest.raises(UserError, match=message):
        generator.generate([PROMPT], **arguments)


def test_what_is_not_a_prompt_list_or_a_model_is_refused(generator, run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the dog =>\n")
    with open(prompts) as f, pytest.raises(UserError, match="not a file"):
        generator.generate(f)
    with pytest.raises(UserError, match=rf"{prompts} is a file: give a run's work directory"):
        Generator.load(prompts)
    with pytest.raises(UserError, match=r"step='1' is str: give a checkpoint's step as an int"):
        Generator.load(run, step="1")


def test_prompts_of_any_short_length_share_one_program(generator):
    before = len(generator._compiled)
    generator.generate(["a"], max_new_tokens=4)
    generator.generate([PROMPT, "b"], max_new_tokens=4)
    assert len(generator._compiled) == before + 1


def test_loading_a_run_says_nothing_of_read_only_directories(run, capfd):
    capfd.readouterr()
    Generator.load(run)
    assert "read only" not in capfd.readouterr().err


def test_a_translation_longer_than_the_model_takes_is_refused():
    # The check comes before any model is touched (this one has none).
    model = translator.Translator.__new__(translator.Translator)
    model.config = transformer_1024.get_config("tiny")
    with pytest.raises(
        UserError, match=r"max_length=100000 is more than the model's positions, model.max_len=64"
    ):
        model.translate(["a sentence"], max_length=100000)


# ----------------------------------------------------- config.json, field by field


@pytest.mark.parametrize(
    "fields, message",
    [
        (
            {
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 32,
                },
            },
            r"config.json: rope_scaling has no low_freq_factor: llama3 RoPE scaling needs",
        ),
        (
            {"num_hidden_layers": -2},
            r"config.json: num_hidden_layers=-2 must be a positive integer",
        ),
        ({"hidden_size": "64"}, r'config.json: hidden_size="64" must be a positive integer'),
        ({"vocab_size": "REMOVE"}, r"config.json: vocab_size is missing"),
        ({"rms_norm_eps": 0}, r"config.json: rms_norm_eps=0 must be a positive number"),
        ({"tie_word_embeddings": "yes"}, r'config.json: tie_word_embeddings="yes" must be true'),
        ({"rope_parameters": 5}, r"config.json: rope_parameters=5 is not an object"),
    ],
)
def test_each_config_json_field_error_names_the_file_and_field(model, tmp_path, fields, message):
    directory = copy(model, tmp_path)
    remove = [k for k, v in fields.items() if v == "REMOVE"]
    if "rope_scaling" in fields:
        remove.append("rope_parameters")  # an older config.json: rope_theta beside rope_scaling
    fields = {k: v for k, v in fields.items() if v != "REMOVE"}
    edit_json(os.path.join(directory, "config.json"), remove=tuple(remove), **fields)
    with pytest.raises(ConfigError, match=rf"^{re.escape(directory)}/{message}"):
        hf_config.read_model_keys(directory)
