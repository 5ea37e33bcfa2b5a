"""A user's mistakes end in one ``error:`` line and a non-zero exit, with no
traceback, across ``trainer``, ``trainer.bench`` and ``launch.local``; a second
run on a busy work directory is refused naming the holder; the launcher's
processes die with it.

The commands run as a user types them, several at a time (each stops before or right
after building the model, so they are short). One runs as a fresh process; the others
as forks of one process that imported JAX and the trainer (tests/forked.py): the same
commands, without 3 s of imports apiece.
"""

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import REPO, command_env, run_command, start_command, tiny_command, tiny_flags

from configs import llama, ncf_16, transformer_1024


def _cases(tmp: str) -> dict[str, tuple[list[str], str]]:
    """``name: (command, text the error line contains)``."""
    afile = os.path.join(tmp, "afile")
    data = os.path.join(tmp, "tfds")

    def python(*args: str) -> list[str]:
        return [sys.executable, "-m", *args]

    def trainer(name: str, **overrides) -> list[str]:
        return tiny_command(os.path.join(tmp, name), data, **overrides)

    def lm(name: str, **overrides) -> list[str]:
        flags = [f"--config.{key}={value}" for key, value in overrides.items()]
        return python(
            "trainer",
            "--config=configs/llama.py:text",
            f"--workdir={os.path.join(tmp, name)}",
            f"--config.data.data_dir={data}",
            "--cpu_devices=8",
            *flags,
        )

    return {
        "no config file": (
            python("trainer", "--config", "configs/nope.py", "--workdir", os.path.join(tmp, "w")),
            "--config configs/nope.py: no such file 'configs/nope.py'",
        ),
        "typo in a key": (
            trainer("typo", num_train_step=8),
            "unknown config key 'num_train_step' (from --config.num_train_step=...); "
            "did you mean 'num_train_steps'?",
        ),
        "empty workdir": (tiny_command("", data), "--workdir is empty"),
        "workdir is a file": (
            tiny_command(afile, data),
            f"--workdir {afile} is a file, not a directory",
        ),
        "negative cpu_devices": (
            python(
                "trainer",
                "--config",
                "configs/transformer_1024.py:tiny",
                "--cpu_devices",
                "-1",
                "--workdir",
                os.path.join(tmp, "cpu"),
            ),
            "--cpu_devices must be >= 0",
        ),
        "keep no checkpoint": (
            trainer("keep", keep_checkpoints=0),
            "keep_checkpoints must be >= 1",
        ),
        "more devices than exist": (
            trainer("mesh", **{"mesh.num_devices": 16}),
            "mesh.num_devices=16 but there are 8 devices",
        ),
        "heads do not divide qkv_dim": (
            trainer("heads", **{"model.num_heads": 5}),
            "model.qkv_dim=64 must split evenly over model.num_heads=5",
        ),
        "model dtype": (
            trainer("dtype", **{"model.dtype": "bfloat61"}),
            "model.dtype='bfloat61' is not a floating-point dtype",
        ),
        "gather dtype": (
            trainer("gdtype", **{"optimizer.gather_dtype": "int3"}),
            "optimizer.gather_dtype='int3' is not a floating-point dtype",
        ),
        "sequences longer than the model": (
            trainer("maxlen", **{"data.max_length": 128}),
            "data.max_length=128 is longer than the model's position table, model.max_len=64",
        ),
        "data_dir is a file": (
            tiny_command(os.path.join(tmp, "dd"), afile),
            f"data.data_dir={afile} is a file, not a directory",
        ),
        "launcher without processes": (
            python("launch.local", "--num_processes", "0", "--", *tiny_flags(tmp, data)),
            "--num_processes must be >= 1, got 0",
        ),
        "launcher with negative processes": (
            python("launch.local", "--num_processes", "-2", "--", *tiny_flags(tmp, data)),
            "--num_processes must be >= 1, got -2",
        ),
        "plot into a directory": (
            python("trainer.plot", os.path.join(tmp, "w"), "--out", tmp),
            f"--out {tmp} is a directory: give the name of a file, e.g. {tmp}/runs.png",
        ),
        # Paths a file system refuses, each named with what is wrong and what to do.
        "workdir under a file (ENOTDIR)": (
            tiny_command(os.path.join(afile, "run"), data),
            f"--workdir {afile}/run: Not a directory ({afile} is a file): move that file away",
        ),
        "workdir in a symlink loop (ELOOP)": (
            tiny_command(os.path.join(tmp, "loop", "run"), data),
            f"--workdir {tmp}/loop/run: Too many levels of symbolic links: its symbolic links "
            "form a loop",
        ),
        "workdir a dangling symlink (EEXIST)": (
            tiny_command(os.path.join(tmp, "dangling"), data),
            f"({tmp}/dangling is a symbolic link to {tmp}/gone, which does not exist): create "
            "what it points to, remove the link",
        ),
        "workdir name too long (ENAMETOOLONG)": (
            tiny_command(os.path.join(tmp, "n" * 300), data),
            "File name too long: a name in it is longer than the file system allows",
        ),
        "checkpoints is a file": (
            tiny_command(os.path.join(tmp, "ck"), data),
            f"{tmp}/ck/checkpoints is a file, where the run keeps its checkpoints: move it away",
        ),
        "hparams path is a directory": (
            tiny_command(os.path.join(tmp, "hp"), data),
            f"{tmp}/hp/events.out.tfevents.0.hparams is a directory, where the run writes its",
        ),
        "bench --json into a directory": (
            python(
                "trainer.bench",
                "--config",
                "configs/transformer_1024.py:tiny,synthetic",
                "--cpu_devices",
                "8",
                "--json",
                tmp,
            ),
            f"--json {tmp} is a directory: give the name of a file, e.g. {tmp}/results.json",
        ),
        "aot --json into a directory": (
            python(
                "trainer.aot",
                "--config",
                "configs/transformer_16.py:synthetic",
                "--topology",
                "v3:4x4",
                "--json",
                tmp,
            ),
            f"--json {tmp} is a directory",
        ),
        "aot with no mode": (
            python(
                "trainer.aot",
                "--config",
                "configs/transformer_16.py:synthetic",
                "--topology",
                "v3:4x4",
                "--modes=",
            ),
            "--modes is empty",
        ),
        "prepare --eval_text on a directory": (
            python(
                "trainer.data.prepare",
                "--config",
                "configs/transformer_1024.py:tiny",
                f"--config.data.data_dir={data}",
                "--eval_text",
                tmp,
            ),
            f"--eval_text {tmp} is a directory",
        ),
        # Values the run cannot represent or use.
        "get_config returns no config": (
            python("trainer", "--config", os.path.join(tmp, "c42.py"), "--workdir", afile),
            f"--config {tmp}/c42.py: get_config() returned int '42', not an "
            "ml_collections.ConfigDict",
        ),
        "a step count beyond int32": (
            trainer("big", num_train_steps=10**20),
            "num_train_steps=100000000000000000000 is beyond what the run can represent",
        ),
        "an unknown fault": (
            ["env", "WUS_FAULT=bogus", *trainer("fault")],
            "WUS_FAULT='bogus': expected <point>:<action>[:<n>]",
        ),
        "translate a recommendation run": (
            python("trainer.translate", "--workdir", os.path.join(tmp, "ncf")),
            "this is a run of model.name='ncf', not a translation model",
        ),
        "translate with stdin closed": (
            ["sh", "-c", f"exec {sys.executable} -m trainer.translate --workdir {tmp}/mt <&-"],
            "stdin is closed: give the sentences on it, one a line",
        ),
        "evaluate a damaged config.json with no checkpoint": (
            python("trainer.evaluate", "--workdir", os.path.join(tmp, "cut")),
            f"{tmp}/cut/config.json is damaged (JSONDecodeError: ",
        ),
        "aot mode unknown": (
            python(
                "trainer.aot",
                "--config",
                "configs/transformer_1024.py:tiny",
                "--topology",
                "v3:2x2",
                "--modes",
                "wus,bogus",
            ),
            "--modes: 'bogus' not one of none, wus, fsdp, per_layer, auto",
        ),
        "init_from its own directory": (
            trainer("own", init_from=os.path.join(tmp, "own")),
            f"init_from={os.path.join(tmp, 'own')} is this run's own work directory",
        ),
        # A language model's input, as a user gets it wrong.
        "an empty corpus": (
            lm("lm1", **{"data.train_files": os.path.join(tmp, "empty.txt")}),
            f"data.train_files: no usable document in {tmp}/empty.txt",
        ),
        "a glob that matches nothing": (
            lm("lm2", **{"data.train_files": os.path.join(tmp, "nothing*.jsonl")}),
            f"data.train_files: no file matches {tmp}/nothing*.jsonl",
        ),
        "a tokenizer that is not one": (
            lm("lm3", **{"data.tokenizer": afile}),
            f"{afile} is not a SentencePiece model",
        ),
        "rows longer than the model takes": (
            lm("lm4", **{"data.max_length": 512}),
            "data.max_length=512 is longer than the model takes, model.max_len=128",
        ),
        "key/value heads that do not divide the heads": (
            lm("lm5", **{"model.num_kv_heads": 3}),
            "model: num_kv_heads=3 must divide num_heads=4",
        ),
        "a tokenizer larger than the model's table": (
            lm("lm6", **{"model.vocab_size": 100}),
            "has 384 ids but model.vocab_size=100",
        ),
        "a ** glob": (
            lm("lm7", **{"data.train_files": f"{tmp}/**/*.txt"}),
            f"data.train_files: {tmp}/**/*.txt has '**' (any depth), which is not supported",
        ),
        "a corpus that is a symbolic link in a loop": (
            lm("lm8", **{"data.train_files": f"{tmp}/loop"}),
            f"data.train_files: {tmp}/loop is a symbolic link in a loop",
        ),
        "a Parquet column of integers": (
            lm("lm9", **{"data.train_files": f"{tmp}/ints.parquet"}),
            f"data.train_files: {tmp}/ints.parquet's column 'text' holds int64, not text",
        ),
        "a remat policy that does not exist": (
            lm("lm10", **{"model.remat": "most"}),
            "model: remat='most' is not one of none, full, dots, dots_no_batch",
        ),
        "a negative layer count": (
            lm("lm11", **{"model.num_layers": -2}),
            "model: num_layers=-2 must be a positive integer",
        ),
        "a token store cut short": (
            lm("lm12", **{"data.tokenized_dir": f"{tmp}/stores/cut"}),
            f"data.tokenized_dir={tmp}/stores/cut: tokens.bin has ",
        ),
        "a token store without its offsets": (
            lm("lm13", **{"data.tokenized_dir": f"{tmp}/stores/nooffsets"}),
            f"data.tokenized_dir={tmp}/stores/nooffsets: the token store has no offsets.npy, "
            "one of its parts: write it again",
        ),
        "a token store of ids past the vocabulary": (
            lm("lm14", **{"data.tokenized_dir": f"{tmp}/stores/ids", "num_train_steps": 2}),
            "of the token store has id 60000, past the 384 ids of its tokenizer",
        ),
        "per_layer on a model without layer stacks": (
            [
                "--config=configs/ncf_16.py:tiny" if arg.startswith("--config=") else arg
                for arg in trainer("ncf_per_layer", **{"optimizer.update_sharding": "per_layer"})
            ],
            "and this model has none: use wus or fsdp (or, for a model with a model.scan_layers "
            "key, set it true)",
        ),
        "an update sharding mode that does not exist": (
            trainer("mode", **{"optimizer.update_sharding": "wsu"}),
            "optimizer.update_sharding must be one of none, wus, fsdp, per_layer, auto, got 'wsu'",
        ),
        # Generation's flags, checked before the prompts are read or the model loaded.
        "generate at temperature nan": (
            python("trainer.generate", f"--workdir={tmp}/lmrun", "--temperature=nan"),
            "temperature=nan is not a finite number: give one 0 (greedy) or more",
        ),
        "generate with top_k above the vocabulary": (
            python("trainer.generate", f"--workdir={tmp}/lmrun", "--top_k=100000"),
            "top_k=100000 is more than the model's 384 ids: give at most 384 (0: all)",
        ),
        "generate more tokens than the context holds": (
            python("trainer.generate", f"--workdir={tmp}/lmrun", "--max_new_tokens=100000"),
            "max_new_tokens=100000 leaves no room for a prompt in the model's context, "
            "model.max_len=128: give at most 127",
        ),
        # A Hugging Face model directory (tests/hf/ for the ones that work), damaged as
        # downloads and hand edits damage them.
        **_hugging_face_cases(tmp, lm),
        "bench loop length": (
            python(
                "trainer.bench",
                "--config",
                "configs/transformer_1024.py:tiny",
                "--steps_per_loop",
                "abc",
                "--cpu_devices",
                "8",
            ),
            "--steps_per_loop: expected loop lengths",
        ),
    }


def _hugging_face_cases(tmp: str, lm) -> dict[str, tuple[list[str], str]]:
    hf = os.path.join(tmp, "hf")

    def import_(name: str) -> list[str]:
        command = lm(f"hf_{name}", num_train_steps=1)
        return [*command[:3], f"--config=configs/llama.py:text,hf={hf}/{name}", *command[4:]]

    return {
        "a model directory without config.json": (
            import_("noconfig"),
            f"{hf}/noconfig is not a Hugging Face model directory: it has no config.json",
        ),
        "an architecture the importer does not take": (
            import_("arch"),
            f'{hf}/arch/config.json: architectures=["GPT2LMHeadModel"] is not supported',
        ),
        "a field that changes the computation": (
            import_("act"),
            f'{hf}/act/config.json: hidden_act="gelu" is not supported',
        ),
        "a missing safetensors shard": (
            import_("shard"),
            f"{hf}/shard/model.safetensors.index.json names model-00002-of-00004.safetensors, "
            "which is missing",
        ),
        "a tensor of another shape than config.json says": (
            import_("shape"),
            "tensor model.layers.0.mlp.gate_proj.weight in model-00002-of-00004.safetensors has "
            "shape (160, 64), but config.json makes it (192, 64)",
        ),
        "a tokenizer larger than the model's embedding": (
            import_("vocab"),
            f"the tokenizer {hf}/vocab/tokenizer.json has 512 ids but model.vocab_size=300",
        ),
        "a config.json with a negative layer count": (
            import_("layers"),
            f"{hf}/layers/config.json: num_hidden_layers=-2 must be a positive integer",
        ),
        "a llama3 rope_scaling missing a key": (
            import_("rope"),
            f"{hf}/rope/config.json: rope_scaling has no low_freq_factor: llama3 RoPE scaling "
            "needs factor, low_freq_factor, high_freq_factor, original_max_position_embeddings",
        ),
        "a safetensors file cut short": (
            import_("cut"),
            f"{hf}/cut/model-00002-of-00004.safetensors is cut short: ",
        ),
        "a weight of integers": (
            import_("int"),
            "safetensors is int32: a weight is floating-point (BF16, F16, F32 or F64)",
        ),
        "evaluate a model directory without documents": (
            [sys.executable, "-m", "trainer.evaluate", f"--workdir={hf}/base"],
            f"--workdir {hf}/base is a Hugging Face model: name the documents to evaluate it on",
        ),
        "an export into the run's checkpoints": (
            [
                sys.executable,
                "-m",
                "trainer.export",
                f"--workdir={tmp}/mt",
                f"--out={tmp}/mt/checkpoints/params",
            ],
            f"--out {tmp}/mt/checkpoints/params is inside the run's checkpoints directory",
        ),
        "an export of a SentencePiece BPE tokenizer": (
            [
                sys.executable,
                "-m",
                "trainer.export",
                f"--workdir={tmp}/bperun",
                "--format=hf",
                f"--out={tmp}/bpe_hf",
            ],
            f"--format hf: the tokenizer.model of {tmp}/bperun is a SentencePiece BPE model",
        ),
        "an export over a directory that is not empty": (
            [
                sys.executable,
                "-m",
                "trainer.export",
                f"--workdir={tmp}/mt",
                "--format=hf",
                f"--out={tmp}/ck",
            ],
            f"--out {tmp}/ck already exists and is not empty",
        ),
    }


def _damaged_models(tmp: str) -> None:
    """A random Llama saved by transformers in 4 shards, and copies damaged."""
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    import make_hf_model  # noqa: PLC0415  (the tests/hf/ models' maker)

    hf = os.path.join(tmp, "hf")
    make_hf_model.make_model(os.path.join(hf, "base"), max_shard_size="200KB")

    def damaged(name, remove=None, drop=(), **fields):
        shutil.copytree(os.path.join(hf, "base"), os.path.join(hf, name))
        file = os.path.join(hf, name, "config.json")
        with open(file) as f:
            config = json.load(f) | fields
        with open(file, "w") as f:
            json.dump({k: v for k, v in config.items() if k not in drop}, f)
        if remove:
            os.remove(os.path.join(hf, name, remove))

    damaged("noconfig", remove="config.json")
    damaged("arch", architectures=["GPT2LMHeadModel"])
    damaged("act", hidden_act="gelu")
    damaged("shard", remove="model-00002-of-00004.safetensors")
    damaged("shape", intermediate_size=192)
    damaged("vocab", vocab_size=300)
    damaged("layers", num_hidden_layers=-2)
    llama3 = dict(
        rope_type="llama3", factor=8.0, high_freq_factor=4.0, original_max_position_embeddings=32
    )
    damaged("rope", drop=("rope_parameters",), rope_scaling=llama3 | {"rope_theta": 1e4})
    damaged("cut")
    shard = os.path.join(hf, "cut", "model-00002-of-00004.safetensors")
    with open(shard, "rb") as f:
        data = f.read()
    with open(shard, "wb") as f:
        f.write(data[: len(data) // 2])
    damaged("int")
    from safetensors.numpy import load_file, save_file  # noqa: PLC0415  (the hf extra)

    with open(os.path.join(hf, "int", "model.safetensors.index.json")) as f:
        shard = os.path.join(hf, "int", json.load(f)["weight_map"]["model.norm.weight"])
    tensors = load_file(shard)
    tensors["model.norm.weight"] = np.ones(tensors["model.norm.weight"].shape, np.int32)
    save_file(tensors, shard, metadata={"format": "pt"})


def _damaged_text(tmp: str) -> None:
    """A language model's input damaged: a Parquet column of integers, token stores cut
    short, without their offsets or with ids past their vocabulary, and a run that
    kept a SentencePiece BPE model."""
    import pyarrow as pa  # noqa: PLC0415  (as the command imports it: for Parquet only)
    import pyarrow.parquet as pq  # noqa: PLC0415
    import sentencepiece as spm  # noqa: PLC0415

    from trainer.input import token_store  # noqa: PLC0415  (NumPy, SentencePiece)
    from trainer.input import tokenizer as tokenizer_lib  # noqa: PLC0415

    pq.write_table(pa.table({"text": [1, 2, 3]}), os.path.join(tmp, "ints.parquet"))
    with open(os.path.join(REPO, "examples", "text", "train", "part-0.txt")) as f:
        documents = f.read().splitlines()[:500]
    tokenizer = tokenizer_lib.train_text_tokenizer(
        os.path.join(tmp, "spm.model"), 384, lambda: documents, description="the sample"
    )
    stores = os.path.join(tmp, "stores")
    for name in ("cut", "nooffsets", "ids"):
        token_store.write(os.path.join(stores, name), documents, tokenizer)
    tokens = os.path.join(stores, "cut", token_store.TOKENS)
    os.truncate(tokens, os.path.getsize(tokens) // 2)
    os.remove(os.path.join(stores, "nooffsets", token_store.OFFSETS))
    ids = np.memmap(os.path.join(stores, "ids", token_store.TOKENS), dtype="<u2", mode="r+")
    ids[::20] = 60_000
    ids.flush()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(documents),
        model_prefix=os.path.join(tmp, "bpe"),
        vocab_size=300,
        model_type="bpe",
        minloglevel=2,
    )
    shutil.copy(os.path.join(tmp, "bpe.model"), os.path.join(tmp, "bperun", "tokenizer.model"))


# What a refused command leaves: nothing at these paths (relative to the cases' root).
LEAVES_NOTHING = {
    "an export of a SentencePiece BPE tokenizer": "bpe_hf",
    "an export into the run's checkpoints": "mt/checkpoints/params",
}


# The cases the default suite runs: one or two of each command and input family.
# ``pytest -m slow`` runs the others.
DEFAULT_CASES = (
    "no config file",
    "typo in a key",
    "aot mode unknown",
    "an empty corpus",
    "a field that changes the computation",
    "an export over a directory that is not empty",
    "generate at temperature nan",
    "an export of a SentencePiece BPE tokenizer",
)
OTHER_CASES = tuple(name for name in _cases("/tmp") if name not in DEFAULT_CASES)


def _results(tmp_path_factory, names, *, fresh: tuple[str, ...] = ()) -> dict:
    """The results of the cases ``names``, run 3 at a time, each with the path it must
    leave empty; the cases ``fresh`` run as fresh processes (conftest.run_command)."""
    tmp = str(tmp_path_factory.mktemp("mistakes"))
    open(os.path.join(tmp, "afile"), "w").close()
    with open(os.path.join(tmp, "empty.txt"), "w") as f:
        f.write("\n\n")
    os.symlink("loop", os.path.join(tmp, "loop"))
    os.symlink(os.path.join(tmp, "gone"), os.path.join(tmp, "dangling"))
    os.makedirs(os.path.join(tmp, "ck"))
    open(os.path.join(tmp, "ck", "checkpoints"), "w").close()
    os.makedirs(os.path.join(tmp, "hp", "events.out.tfevents.0.hparams"))
    with open(os.path.join(tmp, "c42.py"), "w") as f:
        f.write("def get_config():\n    return 42\n")
    # Run directories as far as the commands read them before any checkpoint.
    for name, config in (
        ("ncf", ncf_16.get_config("tiny")),
        ("mt", transformer_1024.get_config("tiny")),
        ("lmrun", llama.get_config("text")),
        ("bperun", llama.get_config("text")),
    ):
        os.makedirs(os.path.join(tmp, name))
        with open(os.path.join(tmp, name, "config.json"), "w") as f:
            f.write(config.to_json_best_effort())
    os.makedirs(os.path.join(tmp, "cut"))
    with open(os.path.join(tmp, "cut", "config.json"), "w") as f:
        f.write(transformer_1024.get_config("tiny").to_json_best_effort()[:100])
    _damaged_models(tmp)
    _damaged_text(tmp)
    cases = {name: case for name, case in _cases(tmp).items() if name in names}
    with ThreadPoolExecutor(3) as pool:  # on 2 cores, one reading its files overlaps another
        done = dict(
            zip(
                cases,
                pool.map(lambda n: run_command(cases[n][0], fresh=n in fresh), cases),
                strict=True,
            )
        )
    return {
        name: (done[name], cases[name][1], os.path.join(tmp, LEAVES_NOTHING.get(name, "none")))
        for name in cases
    }


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # One fresh process: a fork does not show what the imports it inherits print.
    return _results(tmp_path_factory, DEFAULT_CASES, fresh=("no config file",))


@pytest.fixture(scope="module")
def other_results(tmp_path_factory):
    return _results(tmp_path_factory, OTHER_CASES)


def _is_one_error_line(result, message, leaves_nothing_at):
    assert result.returncode not in (0, None), result.stdout[-2000:] + result.stderr[-2000:]
    # Nothing at the path the command would have written, nor a staging directory beside it.
    assert not os.path.exists(leaves_nothing_at)
    parent = os.path.dirname(leaves_nothing_at)
    staged = os.listdir(parent) if os.path.isdir(parent) else []
    assert not [n for n in staged if ".partial-" in n], staged
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, result.stderr[-3000:]
    assert message in errors[0], errors[0]
    assert result.stderr.strip().splitlines()[-1] == errors[0]


@pytest.mark.parametrize("name", DEFAULT_CASES)
def test_mistake_is_one_error_line(results, name):
    _is_one_error_line(*results[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_CASES)
def test_more_mistakes_are_one_error_line(other_results, name):
    _is_one_error_line(*other_results[name])


def test_busy_workdir_is_refused_naming_the_holder(tmp_path):
    import fcntl

    # A live run's lock: held (flock) by this process, with the holder's description.
    lock = os.open(tmp_path / "run.lock", os.O_RDWR | os.O_CREAT)
    holder = {
        "id": "x",
        "host": "otherhost",
        "pid": 4242,
        "started": time.time(),
        "command": "python -m trainer --config first",
    }
    os.write(lock, json.dumps(holder).encode())
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        result = run_command(tiny_command(tmp_path, tmp_path / "tfds"))
    finally:
        os.close(lock)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(
        f"error: {tmp_path} is in use by another run (pid 4242 on host otherhost, started "
    ), last
    assert "python -m trainer --config first" in last
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "config.json").exists()


def _descendants(pid: int) -> set[int]:
    """Every process under ``pid`` (children, their children, ...), from /proc."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue
    found, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        for child, its_parent in parents.items():
            if its_parent == parent and child not in found:
                found.add(child)
                todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


def _command_line(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:200]
    except FileNotFoundError:
        return "(gone)"


def _kill_launcher_when(workdir, data, ready, **overrides) -> list[str]:
    """Starts ``launch.local`` (2 processes, ``--grace`` 10 s) on ``workdir``; once
    ``ready(lines so far)``, SIGKILLs it and checks that none of its processes lives 30 s
    later. Returns its output.

    A process that has not saved and stopped by itself kills itself ``grace`` seconds
    after its parent-death signal is read; the 20 s beyond it are for that signal's
    reading on a loaded machine (with the default grace of 30 s, a process killed on
    time could still be seen alive at the check)."""
    flags = tiny_flags(
        workdir,
        data,
        **{
            "num_train_steps": 100000,
            "steps_per_loop": 2,
            "log_every_steps": 2,
            "checkpoint_every_steps": 2,
            "eval_every_steps": 0,
            "data.num_eval_examples": 16,
            **overrides,
        },
    )
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "launch.local",
            "--num_processes=2",
            "--cpu_devices=2",
            "--grace=10",
            "--",
            *flags,
        ],
        cwd=REPO,
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, deadline = [], time.time() + 300
    try:
        while not ready(lines) and time.time() < deadline:
            line = launcher.stdout.readline()
            assert line or launcher.poll() is None, "".join(lines)[-3000:]
            lines.append(line)
        assert ready(lines), "".join(lines)[-3000:]
        processes = _descendants(launcher.pid)
        assert len(processes) >= 2, processes
    finally:
        launcher.kill()
        launcher.wait()
    deadline = time.time() + 30
    while any(map(_alive, processes)) and time.time() < deadline:
        time.sleep(0.2)
    left = {pid: _command_line(pid) for pid in processes if _alive(pid)}
    for pid in left:  # do not leave them running if the test fails
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived their launcher by 30 s:\n" + "".join(lines)[-2000:]
    return lines


@pytest.mark.soak
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux only)")
def test_launcher_killed_mid_loop_or_mid_save_takes_its_processes_along(tmp_path):
    workdir, data = str(tmp_path / "run"), str(tmp_path / "tfds")
    checkpoints = tmp_path / "run" / "checkpoints"

    # SIGKILL while a loop runs: the processes have logged a step, and a checkpoint is
    # complete (a step's directory; the first save may still be in flight at its step's
    # line, and a kill then leaves nothing for the second run to resume from).
    def running(lines):
        complete = checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())
        return complete and any("[p0] step" in line for line in lines)

    _kill_launcher_when(workdir, data, running)

    # Again, while a save is written (a temporary directory after a complete checkpoint).
    def saving(lines):
        if not any("[p0] step" in line for line in lines[-1:]):
            return False
        deadline = time.time() + 5
        while time.time() < deadline:
            if glob.glob(str(checkpoints / "*tmp*")):
                return True
            time.sleep(0.002)
        return False

    lines = _kill_launcher_when(workdir, data, saving)
    assert any("resumed from the checkpoint of step" in line for line in lines), lines[-20:]
    # A new run takes the directory over and resumes from the newest complete checkpoint.
    newest = max(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    result = run_command(
        tiny_command(
            workdir, data, num_train_steps=newest + 2, steps_per_loop=2, eval_every_steps=0
        )
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert f"resumed from the checkpoint of step {newest}" in result.stdout
    assert not glob.glob(str(checkpoints / "*tmp*"))


@pytest.mark.soak  # waits out a previous run's process
def test_new_run_waits_for_the_last_process_of_the_previous_one(tmp_path):
    import fcntl

    # A process of an earlier job still holds its share of the directory (run.lock is free).
    peers = os.open(tmp_path / "run.lock.peers", os.O_RDWR | os.O_CREAT)
    fcntl.flock(peers, fcntl.LOCK_SH)
    proc = start_command(
        tiny_command(
            tmp_path, tmp_path / "tfds", num_train_steps=2, steps_per_loop=2, eval_every_steps=0
        )
    )
    try:
        # The config block and the compilation cache are said before the lock is taken.
        first = proc.stdout.readline()
        while first and not first.startswith("warning:"):
            first = proc.stdout.readline()
        assert first.startswith(
            f"warning: waiting for processes of the previous run in {tmp_path} to exit (pids "
            f"{os.getpid()})"
        ), first
        time.sleep(1.0)
        assert proc.poll() is None and not (tmp_path / "config.json").exists()
    finally:
        os.close(peers)  # the straggler exits
    out = first + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and (tmp_path / "checkpoints" / "2").is_dir()
    assert not (tmp_path / "run.lock.peers").exists()  # no straggler left: removed at exit


@pytest.mark.parametrize("delay", [0.1, 0.4, 1.0, 1.8])
def test_ctrl_c_twice_while_starting_is_a_clean_exit(tmp_path, delay):
    # Python's own start-up (site packages, then runpy importing the trainer package and
    # reading trainer/__main__.py) runs before the command's first line: about 30 ms on
    # a quiet machine, more than 100 ms on a loaded one. A Ctrl-C that lands there gets
    # Python's traceback, whose frames are all Python's own (<frozen ...>) or the
    # package's __init__ (library code: it may not take over Ctrl-C for the process):
    # the command cannot reach it, so such a try is made again, later the next time.
    before_main = ("<frozen", os.path.join(REPO, "trainer", "__init__.py"))
    for attempt in range(4):
        proc = subprocess.Popen(
            tiny_command(tmp_path, tmp_path / "tfds"),
            cwd=REPO,
            env=command_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(delay * (1 + attempt))
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        frames = re.findall(r'^  File "(.+?)"', err, re.M)
        if not (frames and all(f.startswith(before_main) for f in frames)):
            break
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.soak
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal: Linux")
def test_a_run_right_after_a_killed_launcher_waits_for_its_processes(tmp_path):
    workdir, data = str(tmp_path / "run"), str(tmp_path / "tfds")
    flags = tiny_flags(
        workdir,
        data,
        num_train_steps=100000,
        steps_per_loop=100,
        log_every_steps=100,
        checkpoint_every_steps=100,
        eval_every_steps=0,
    )
    launch = ["launch.local", "--num_processes=2", "--cpu_devices=2", "--grace=20", "--"]
    launcher = start_command([sys.executable, "-m", *launch, *flags])
    processes = []
    try:
        for line in launcher.stdout:
            if "[p0] step" in line:
                break
        processes = sorted(_descendants(launcher.pid))
    finally:
        launcher.kill()
        launcher.wait()
    # Frozen, its processes hold the directory until the new run has said that it waits
    # for them, whatever either's speed (running, they could reach a loop boundary, save
    # and be gone before the new run asks). Frozen only once the launcher is gone: a
    # stopped process in a process group that its parent's death orphans gets SIGHUP.
    for pid in processes:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    new_run = start_command(
        tiny_command(workdir, data, num_train_steps=2, steps_per_loop=2, eval_every_steps=0)
    )
    said = []
    try:
        for line in new_run.stdout:
            said.append(line)
            if "whose launcher has died" in line:
                break
    finally:
        # Thawed, each takes its parent-death signal: it saves at its loop's end or kills
        # itself after --grace (20 s), inside the new run's 30 s.
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    out = "".join(said) + new_run.communicate(timeout=300)[0]
    assert new_run.returncode == 0, out[-3000:]
    assert "whose launcher has died: waiting up to 30s for it to save and exit" in out, out[-3000:]
    assert "Traceback" not in out


@pytest.mark.parametrize("delay", [0.3, 1.0])
def test_ctrl_c_while_prepare_starts_is_one_line(tmp_path, delay):
    # Its modules import for seconds (JAX, TFDS): a Ctrl-C then was a traceback.
    command = ["trainer.data.prepare", "--config=configs/llama.py:text", f"--out={tmp_path}/s"]
    proc = subprocess.Popen(
        [sys.executable, "-m", *command],
        cwd=REPO,
        env=command_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert err.strip().splitlines()[-1:] in ([], ["interrupted (Ctrl-C)"]), err[-3000:]


def test_a_comma_list_is_taken_where_a_tuple_of_paths_is(tmp_path):
    # text_pairs' data.train_files is a tuple; text_files' a string: both take a,b.
    command = [sys.executable, "-m", "trainer", "--config=configs/transformer_1024.py:tiny"]
    result = run_command(
        [
            *command,
            "--config.data.name=text_pairs",
            f"--config.data.train_files={tmp_path}/a.tsv,{tmp_path}/b*.tsv",
            "--print_config",
        ]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"data.train_files = ('{tmp_path}/a.tsv', '{tmp_path}/b*.tsv')" in result.stdout


def test_plotting_runs_of_different_tokenizers_says_so(tmp_path, capsys):
    from trainer import plot

    for name, model in (("a", b"one"), ("b", b"two"), ("c", b"one")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.model").write_bytes(model)
    plot._warn_of_tokenizers([str(tmp_path / "a"), str(tmp_path / "c")])
    assert capsys.readouterr().err == ""
    plot._warn_of_tokenizers([str(tmp_path / n) for n in "abc"])
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: the runs tokenize differently: {tmp_path}/a (")
    assert line.endswith(
        "their loss, eval/nll and eval/perplexity are per token of different "
        "tokenizers and do not compare"
    )
