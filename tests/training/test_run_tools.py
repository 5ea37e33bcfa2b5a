"""What users do around a run, on one tiny trained run (logged to W&B offline and
resumed once): evaluate and translate its checkpoints from the command line, start
new runs from its export (any mesh and mode), profile, plot."""

import ast
import glob
import json
import os
import re
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from conftest import REPO, command_env, run_command, tiny_command, tiny_translation
from etils import epath

from configs import transformer_1024
from models import decode as decode_lib
from trainer import checkpoint as checkpoint_lib
from trainer import tasks
from trainer.analysis import figures
from trainer.errors import ConfigError, UserError
from trainer.inference import export as export_lib
from trainer.input import translation as data_lib
from trainer.reporting import metrics
from trainer.training import experiment
from trainer.training import train as train_lib
from trainer.workdir import run_config


def tiny(data_dir, **overrides):
    # One module per layer: init_from_skip and the checks name layers one by one
    # (test_export_and_init_from_convert_between_layer_stacks_and_layers: the stacks).
    return tiny_translation(
        data_dir,
        **{
            "model.scan_layers": False,
            "data.num_eval_examples": 32,
            "max_decode_length": 16,
            "optimizer.warmup_steps": 10,
            "num_train_steps": 40,
            "steps_per_loop": 10,
            "log_every_steps": 10,
            "eval_every_steps": 20,
            "checkpoint_every_steps": 20,
            **overrides,
        },
    )


WANDB = {"wandb.project": "wus-test"}


@pytest.fixture(scope="module")
def run(data_dir, tmp_path_factory):
    """A 40-step wus run on 8 devices, logged to W&B offline: 20 steps, then resumed
    to 40; checkpoints and evaluations at 20 and 40."""
    workdir = str(tmp_path_factory.mktemp("run"))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("WANDB_MODE", "offline")
        train_lib.train(tiny(data_dir, num_train_steps=20, **WANDB), workdir)
        train_lib.train(tiny(data_dir, **WANDB), workdir)
    return workdir


def cli(module, *args, stdin=None):
    result = run_command([sys.executable, "-m", module, *args], timeout=600, stdin=stdin)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_run_config_round_trips():
    for variant in ("tiny", "", "base,synthetic"):
        config = transformer_1024.get_config(variant)
        again = run_config.from_json(config.to_json_best_effort())
        assert again.to_dict() == config.to_dict()
        assert isinstance(again.mesh.rules, tuple) and again.mesh.rules[2] == ("embed", None)


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_evaluate_a_checkpoint_on_another_mesh(run):
    result = cli(
        "trainer.evaluate",
        "--workdir",
        run,
        "--step",
        "20",
        "--cpu_devices",
        "4",
        "--config.mesh.axes.model=2",
    )
    logged = {row["step"]: row for row in read_jsonl(os.path.join(run, "metrics.jsonl"))}[20]
    (row,) = read_jsonl(os.path.join(run, "eval.jsonl"))
    assert row["step"] == 20 and row["overrides"] == {"mesh.axes.model": 2}
    # Another mesh (data 2 x model 2) sums in another order; evaluation computes in f32
    # (eval_dtype), so only the last digits move.
    for key in ("eval/loss", "eval/accuracy", "eval/nll"):
        assert row[key] == pytest.approx(logged[key], rel=1e-5), key
    assert row["eval/bleu"] == logged["eval/bleu"]
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("step 20 | ") and "eval/bleu" in line
    # The result is in TensorBoard too: the run "evaluate" inside the run's directory.
    from tensorboard.backend.event_processing import event_accumulator

    events = event_accumulator.EventAccumulator(os.path.join(run, "evaluate"))
    events.Reload()
    (point,) = events.Scalars("eval/bleu")
    assert point.step == 20 and point.value == pytest.approx(row["eval/bleu"])


@pytest.mark.slow  # commands run end to end: 13-25 s
def test_evaluation_does_not_depend_on_the_device_count(run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(run, workdir)
    for devices in (1, 2, 8):
        cli("trainer.evaluate", "--workdir", workdir, f"--cpu_devices={devices}")
    logged = {row["step"]: row for row in read_jsonl(os.path.join(run, "metrics.jsonl"))}[40]
    evaluated = read_jsonl(os.path.join(workdir, "eval.jsonl"))[-3:]
    for row in evaluated:  # the training's own evaluation ran on 8 devices
        assert row["step"] == 40 and row["eval/bleu"] == logged["eval/bleu"]
        for key in ("eval/loss", "eval/accuracy", "eval/nll"):
            assert row[key] == pytest.approx(logged[key], rel=1e-5), key


@pytest.mark.slow  # commands run end to end: 13-25 s
def test_evaluate_errors_are_one_line(run):
    for args, message in [
        (["--step", "7"], "no checkpoint of step 7"),
        (["--config.eval_bogus=1"], "unknown config key 'eval_bogus'"),
    ]:
        evaluate = [sys.executable, "-m", "trainer.evaluate", "--workdir", run, "--cpu_devices=8"]
        result = run_command([*evaluate, *args])
        assert result.returncode != 0
        assert result.stderr.strip().splitlines()[-1].startswith(f"error: {message}"), (
            result.stderr[-2000:]
        )


def _restored_params(workdir, config):
    model = experiment.build_model(config, with_data=False)
    checkpoints = checkpoint_lib.CheckpointReader(workdir)
    params = checkpoints.restore_state_parts(40, {"params": model.abstract_params})
    checkpoints.close()
    return model.task.model, jax.device_get(params["params"])


@pytest.mark.slow  # commands run end to end: 13-25 s
def test_translate_with_beam_search(run, data_dir):
    config = tiny(data_dir)
    vocab = data_lib.load_vocab(config.data)
    sources, _ = tasks.open_data(config).eval_references()
    long = " ".join(sources[:8])  # beyond data.max_length tokens: cut, as in evaluation
    lines = [*sources[:24], "", long]
    # f32 compute (an override of the run's config), so that the reference below, on
    # another device layout, rounds alike and ranks near-equal hypotheses alike.
    result = cli(
        "trainer.translate",
        "--workdir",
        run,
        "--beam_size",
        "4",
        "--cpu_devices",
        "4",
        "--batch_size",
        "8",
        "--config.model.dtype=float32",
        stdin="".join(s + "\n" for s in lines),
    )
    out = result.stdout.split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == ""
    assert out[24] == "" and "1 sources cut at 48 tokens" in result.stderr
    assert "sentences/s" in result.stderr

    # Reference: the model's beam search on one padded batch, in this process.
    model, params = _restored_params(run, tiny(data_dir, **{"model.dtype": "float32"}))
    tokens = [vocab.encode(s) for s in sources[:24]]
    batch = np.zeros((24, max(map(len, tokens))), np.int32)
    for i, t in enumerate(tokens):
        batch[i, : len(t)] = t
    best = jax.jit(
        lambda p, x: decode_lib.decode(model, p, x, beam_size=4, max_decode_len=16, alpha=0.6)
    )(params, jnp.asarray(batch))
    assert out[:24] == [vocab.decode(row) for row in np.asarray(best)]
    assert sum(a == b for a, b in zip(out[:24], sources[:24], strict=True)) == 0
    assert out[25]  # the cut source still translates


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_translate_bad_input_costs_its_own_line(run):
    lines = [
        b"every ship holds your dark chair",
        b"\xff\xfe not utf-8",
        b"a NUL \x00 byte",
        b"every ship " * 200_000,  # 2.2 MB: cut at data.max_length tokens
        b"their proud forest greets your calm old cake",
        b"a lone \r carriage return stays inside its line\r",  # and a \r\n line end
    ]
    result = subprocess.run(
        [sys.executable, "-m", "trainer.translate", "--workdir", run, "--cpu_devices=8"],
        input=b"\n".join(lines) + b"\n",
        capture_output=True,
        cwd=REPO,
        env=command_env(),
        timeout=600,
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
    out = result.stdout.decode().split("\n")
    assert len(out) == len(lines) + 1 and out[-1] == ""
    assert out[0] and out[3] and out[4] and out[5] and out[1] == out[2] == ""
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: input line 2 is not UTF-8 text (byte 0xff at column 0): its translation is "
        "left empty",
        "warning: input line 3 has NUL bytes (binary input?): its translation is left empty",
    ]
    assert "1 sources cut at 48 tokens" in stderr


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_evaluate_prints_what_it_cannot_record(run, tmp_path):
    workdir = str(tmp_path / "run")
    shutil.copytree(run, workdir)
    results = os.path.join(workdir, "eval.jsonl")
    if os.path.exists(results):
        os.remove(results)
    os.mkdir(results)  # a directory: cannot be appended to
    result = cli("trainer.evaluate", "--workdir", workdir, "--cpu_devices=8")
    assert result.stdout.startswith("step 40 | eval/"), result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        f"warning: could not record the result in {workdir}/eval.jsonl ({workdir}/eval.jsonl: "
        "Is a directory: give the name of a file, not of a directory); it is only in the line "
        "above"
    )


@pytest.mark.slow  # commands run end to end: 13-25 s
def test_init_from_export_on_another_mesh_and_mode_with_a_trace(run, data_dir, tmp_path):
    export_lib.export(run, str(tmp_path / "params"), dtype="bfloat16")
    exported = ocp.StandardCheckpointer().restore(str(tmp_path / "params"))
    # Learning rate 0: the state after the steps holds the initial params. The run is
    # a command of its own, as a user's is (and so no profiler starts in a test worker
    # that has loaded torch for the Hugging Face tests: stopping a trace there crashed).
    overrides = {
        "init_from": str(tmp_path / "params"),
        "init_from_skip": '("decoder_layers_1/mlp/wo/*",)',
        "mesh.num_devices": 4,
        "optimizer.update_sharding": "fsdp",
        "global_batch_size": 16,
        "optimizer.learning_rate": 0.0,
        "num_train_steps": 10,
        "steps_per_loop": 5,
        "log_every_steps": 5,
        "eval_every_steps": 0,
        "checkpoint_every_steps": 0,
        "profile_steps": "5,5",
        "model.scan_layers": False,
    }
    workdir = tmp_path / "finetune"
    result = run_command(tiny_command(str(workdir), data_dir, **overrides), timeout=600)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert "init_from: 63 of 65 parameters" in out
    assert (
        "from their initialisers: decoder_layers_1/mlp/wo/bias, decoder_layers_1/mlp/wo/kernel"
        in out
    )
    export_lib.export(str(workdir), str(tmp_path / "after"))
    got = ocp.StandardCheckpointer().restore(str(tmp_path / "after"))
    exp = experiment.build(tiny(data_dir, **{"mesh.num_devices": 4}))
    with jax.set_mesh(exp.mesh):
        fresh = jax.device_get(jax.jit(exp.plan.to_logical)(exp.init().params))
    for name in (
        "encoder_layers_0/attention/query",
        "decoder_layers_1/mlp/wi/kernel",
        "shared_embedding/embedding",
    ):
        np.testing.assert_array_equal(_get(got, name), _get(exported, name).astype(np.float32))
    skipped = "decoder_layers_1/mlp/wo/kernel"
    np.testing.assert_array_equal(_get(got, skipped), _get(fresh, skipped))
    assert not np.array_equal(_get(got, skipped), _get(exported, skipped).astype(np.float32))

    # The trace of steps 6-10, where TensorBoard's profile plugin looks for it.
    (trace,) = glob.glob(str(workdir / "profile" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    with open(trace, "rb") as f:
        content = f.read()
    assert b"train_loop" in content and len(content) > 100_000
    assert "profile of steps 6-10" in out
    # Beside it the same trace as JSON, whose ops scripts/op_times.py sums: the 5 steps'
    # matmuls, and fsdp's gathers and reduce-scatters, on each of the 4 devices.
    summary = run_command(
        [sys.executable, "scripts/op_times.py", str(workdir), "--steps=5", "--devices=4"]
    )
    assert summary.returncode == 0, summary.stderr[-3000:]
    kinds = dict(re.findall(r"^  (matmuls|collectives|all ops) +([\d.]+)$", summary.stdout, re.M))
    assert set(kinds) == {"matmuls", "collectives", "all ops"}, summary.stdout
    assert 0 < float(kinds["matmuls"]) < float(kinds["all ops"])
    assert 0 < float(kinds["collectives"]) < float(kinds["all ops"])


def _get(tree, name):
    for part in name.split("/"):
        tree = tree[part]
    return tree


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_init_from_lists_every_mismatch(run, data_dir, tmp_path):
    config = tiny(
        data_dir, **{"init_from": run, "model.num_decoder_layers": 3, "model.mlp_dim": 128}
    )
    with pytest.raises(ConfigError) as error:
        train_lib.train(config, str(tmp_path))
    message = str(error.value)
    assert "init_from: 30 parameters do not fit checkpoint 40 of" in message
    assert "encoder_layers_0/mlp/wi/kernel is (64, 256) there, (64, 128) here" in message
    assert "decoder_layers_2/cross_attention/key (4, 16, 64) is missing" in message
    config = tiny(data_dir, init_from=run, init_from_skip=("nothing/*",))
    with pytest.raises(ConfigError, match=r"init_from_skip patterns \['nothing/\*'\] match no"):
        train_lib.train(config, str(tmp_path))


def test_profile_steps_must_fit_the_loops(data_dir, tmp_path):
    with pytest.raises(ConfigError, match=r"profile_steps=\(10, 5\).*steps_per_loop=10.*=5"):
        train_lib.train(tiny(data_dir, profile_steps=(10, 5)), str(tmp_path))


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_norms_on_the_console_and_in_the_metrics(run):
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    for row in rows:
        assert row["grad_norm"] > 0 and row["update_norm"] > 0 and row["param_norm"] > 10
    # The parameter norm is the state's: it moves little from one log step to the next.
    assert abs(rows[-1]["param_norm"] - rows[-2]["param_norm"]) < 0.1 * rows[-1]["param_norm"]


class _Device:
    def __init__(self, stats):
        self._stats = stats

    def memory_stats(self):
        return self._stats


def test_device_memory_where_reported():
    assert metrics.device_memory([_Device(None), _Device(None)]) == {}  # CPU
    gib = 2**30
    got = metrics.device_memory(
        [
            _Device(
                {"bytes_in_use": 1 * gib, "peak_bytes_in_use": 3 * gib, "bytes_limit": 16 * gib}
            ),
            _Device(
                {"bytes_in_use": 2 * gib, "peak_bytes_in_use": 2 * gib, "bytes_limit": 16 * gib}
            ),
        ]
    )
    assert got == {
        "memory/bytes_in_use": 2.0 * gib,
        "memory/peak_bytes_in_use": 3.0 * gib,
        "memory/bytes_limit": 16.0 * gib,
    }


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_plot_runs_and_bench(run, tmp_path):
    import matplotlib.image

    out = tmp_path / "runs.png"
    result = cli("trainer.plot", run, run, "--out", str(out), "--names", "a,b")
    metrics = (
        "loss, eval/accuracy, eval/bleu, eval/chrf, eval/exact_match, eval/loss, eval/nll, "
        "eval/perplexity"
    )
    assert f"{metrics} of 2 run(s)" in result.stderr
    image = matplotlib.image.imread(str(out))
    assert image.shape[0] > 300 and image.shape[1] > 600
    series = figures.read_series(run)
    assert [s for s, _ in series["loss"]] == [10, 20, 30, 40]

    bench = {
        mode: {
            "step_time_s": t,
            "state_bytes_per_device": b,
            "temp_bytes": b / 2,
            "collective_bytes": {"all-reduce f32": 2e6}
            if mode == "none"
            else {"all-gather bf16": 5e5, "reduce-scatter f32": 1e6},
        }
        for mode, t, b in (("none", 0.02, 8e6), ("wus", 0.015, 1e6))
    }
    figures.plot_bench(bench, str(tmp_path / "bench.png"))
    assert matplotlib.image.imread(str(tmp_path / "bench.png")).shape[1] > 800


def _wandb_records(path):
    """The records of an offline W&B run file (a LevelDB-style log of protobufs)."""
    from wandb.proto import wandb_internal_pb2

    with open(path, "rb") as f:
        data = f.read()
    records, pending, pos, block = [], b"", 7, 32768
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if left < 7 or (kind == 0 and length == 0):
            pos += left
            continue
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_wandb_offline_resumes_the_same_run(run):
    # The shared run logged to W&B offline, stopped at 20 and was resumed to 40.
    workdir = epath.Path(run)
    run_id = (workdir / "wandb_run_id").read_text().strip()
    files = sorted(glob.glob(str(workdir / "wandb" / "offline-run-*" / "run-*.wandb")))
    assert len(files) == 2 and all(f.endswith(f"run-{run_id}.wandb") for f in files)
    logged = {}
    for path in files:
        for record in _wandb_records(path):
            if record.WhichOneof("record_type") == "run":
                assert record.run.run_id == run_id and record.run.project == "wus-test"
            if record.WhichOneof("record_type") == "history":
                row = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json)
                    for i in record.history.item
                }
                if "train/loss" in row:  # (W&B also records rows of its own)
                    logged[row["_step"]] = row["train/loss"]
    want = {row["step"]: row["loss"] for row in read_jsonl(workdir / "metrics.jsonl")}
    assert logged == want and sorted(want) == [10, 20, 30, 40]


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_summary_of_the_resumed_run(run):
    summary = json.loads((epath.Path(run) / "summary.json").read_text())
    rows = read_jsonl(os.path.join(run, "metrics.jsonl"))
    evals = [r for r in rows if "eval/loss" in r]
    assert (summary["first_step"], summary["last_step"], summary["steps_trained"]) == (20, 40, 20)
    # The last evaluation's metrics, not its row's training loss.
    want = {k: v for k, v in evals[-1].items() if k == "step" or k.startswith("eval/")}
    assert summary["final_eval"] == want and summary["final_eval"]["step"] == 40
    assert "loss" not in summary["final_eval"] and "eval/bleu" in summary["final_eval"]
    best_loss = min(evals, key=lambda r: r["eval/loss"])
    best_bleu = max(evals, key=lambda r: r["eval/bleu"])
    assert summary["best_eval"]["eval/loss"] == {
        "value": best_loss["eval/loss"],
        "step": best_loss["step"],
    }
    assert summary["best_eval"]["eval/bleu"]["value"] == best_bleu["eval/bleu"]
    assert summary["newest_checkpoint"] == os.path.join(run, "checkpoints", "40")
    wall = summary["wall_time_s"]
    assert wall["total"] >= wall["compile"] + wall["train"] + wall["eval"] > 0
    assert {"metrics.jsonl", "config.json", "checkpoints", "summary.json"} <= set(summary["files"])
    assert not {"run.lock", "run.lock.peers"} & set(os.listdir(run))  # gone at a clean exit
    assert not any(name.startswith("run.lock") for name in summary["files"])
    assert summary["status"] == "finished"
    assert f"python -m trainer.evaluate --workdir {run} --cpu_devices 8" in summary["commands"]
    assert summary["steps_per_sec"] == pytest.approx(20 / wall["train"])
    assert not any("mfu" in row for row in rows)  # a CPU has no known peak: no MFU


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_tensorboard_reads_train_and_eval_scalars_and_the_config(run):
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = event_accumulator.EventAccumulator(run)
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/learning_rate", "eval/loss", "eval/bleu"} <= set(scalars)
    assert "loss" not in scalars  # every training scalar is under train/
    want = {row["step"]: row["loss"] for row in read_jsonl(os.path.join(run, "metrics.jsonl"))}
    got = {e.step: e.value for e in events.Scalars("train/loss")}
    assert got == pytest.approx(want)
    # The config as hparams, the way the HParams dashboard reads them.
    content = events.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["num_train_steps"].number_value == 40
    assert start.hparams["model.name"].string_value == "transformer"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(
        content["_hparams_/experiment"]
    ).experiment
    assert {"train/loss", "eval/bleu"} <= {m.name.tag for m in experiment.metric_infos}


def test_translate_input_lines_end_at_newlines_only():
    from trainer.inference import translator as decoding

    lines, problems = decoding.read_lines(b"a\rb\nc\r\nd\x00e\n\xff\n\nlast")
    assert lines == ["a b", "c", None, None, "", "last"]
    assert [i for i, _ in problems] == [2, 3]
    assert decoding.read_lines(b"") == ([], []) and decoding.read_lines(b"\n") == ([""], [])
    rng = np.random.default_rng(0)
    for _ in range(50):  # any bytes: one entry per line
        data = rng.integers(0, 256, rng.integers(0, 400), dtype=np.uint8).tobytes()
        expected = data.count(b"\n") + (bool(data) and not data.endswith(b"\n"))
        assert len(decoding.read_lines(data)[0]) == expected


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_export_and_init_from_convert_between_layer_stacks_and_layers(run, data_dir, tmp_path):
    from trainer.training import init_from

    export_lib.export(run, str(tmp_path / "layers"))
    export_lib.export(run, str(tmp_path / "stacked"), scan_layers=True)
    layers = ocp.StandardCheckpointer().restore(str(tmp_path / "layers"))
    stacked = ocp.StandardCheckpointer().restore(str(tmp_path / "stacked"))
    assert "encoder_layers_0" in layers and "encoder_layers_0" not in stacked
    query = stacked["encoder_layers"]["attention"]["query"]
    assert query.shape == (2, 4, 16, 64)
    np.testing.assert_array_equal(query[1], layers["encoder_layers_1"]["attention"]["query"])
    # A scanned run starts from the unscanned run's checkpoint, an unscanned one from the
    # stacked export: every parameter arrives, converted.
    for source, scan in ((run, True), (str(tmp_path / "stacked"), False)):
        exp = experiment.build(tiny(data_dir, init_from=source, **{"model.scan_layers": scan}))
        said = []
        state = init_from.initial_state(exp, said.append)
        assert said[0].startswith("init_from: ") and "converted between layer stacks" in said[0]
        with jax.set_mesh(exp.mesh):
            got = jax.device_get(jax.jit(exp.plan.to_logical)(state.params))
        want = stacked if scan else layers
        for name in (
            "encoder_layers/mlp/wi/kernel" if scan else "encoder_layers_1/mlp/wi/kernel",
            "decoder_layers/cross_attention/out" if scan else "decoder_layers_0/mlp/wo/bias",
            "shared_embedding/embedding",
        ):
            np.testing.assert_array_equal(_get(got, name), _get(want, name), err_msg=name)


def _log_probs_reference(model, params, vocab, source, target) -> float:
    """log p(target | source), one unpadded pair, summed in numpy."""
    inputs = np.asarray([vocab.encode(source)], np.int32)
    targets = np.asarray([vocab.encode(target)], np.int32)
    logits = np.asarray(model.apply({"params": params}, inputs, targets, train=False), np.float64)[
        0
    ]
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return float(sum(log_p[i, t] for i, t in enumerate(targets[0])))


@pytest.mark.slow  # ~12 s; docs/python_api.md's example stays in the default suite
def test_the_python_api_translates_and_scores_from_a_run_and_an_export(run, data_dir, tmp_path):
    from trainer import Translator

    f32 = {"model.dtype": "float32"}
    config = tiny(data_dir, **f32)
    vocab = data_lib.load_vocab(config.data)
    sources, references = tasks.open_data(config).eval_references()
    model, params = _restored_params(run, config)

    translator = Translator.load(run, config=config)
    assert translator.step == 40
    got = translator.translate([*sources[:6], ""], beam_size=1, batch_size=4)
    tokens = [vocab.encode(s) for s in sources[:6]]
    batch = np.zeros((6, max(map(len, tokens))), np.int32)
    for i, t in enumerate(tokens):
        batch[i, : len(t)] = t
    best = decode_lib.decode(
        model, params, jnp.asarray(batch), beam_size=1, max_decode_len=16, alpha=0.6
    )
    assert got == [*(vocab.decode(row) for row in np.asarray(best)), ""]

    pairs = list(zip(sources[:5], references[:5], strict=True)) + [(sources[0], "a b c")]
    scores = translator.score([s for s, _ in pairs], [t for _, t in pairs], batch_size=4)
    want = [_log_probs_reference(model, params, vocab, s, t) for s, t in pairs]
    np.testing.assert_allclose(scores, want, rtol=1e-4)
    with pytest.raises(ConfigError, match="2 sources but 1 targets"):
        translator.score(["a", "b"], ["c"])
    # Arguments a clumsy caller gives: the project's one user-error type, naming them.
    with pytest.raises(UserError, match="sentences: give a list of strings, not one str"):
        translator.translate("one sentence")
    with pytest.raises(UserError, match=r"sentences\[1\] is NoneType None, not a string"):
        translator.translate(["a", None])
    with pytest.raises(UserError, match=r"sources\[0\] is NoneType"):
        translator.score([None], ["x"])
    with pytest.raises(UserError, match="neither a run's work directory .* nor an export"):
        Translator.load(tmp_path / "nowhere")

    # An export (its layers stacked) carries its config and vocabulary: it loads alone.
    out = tmp_path / "export"
    export_lib.export(run, str(out), scan_layers=True)
    assert (out / "vocab.model").read_bytes() == vocab.serialized
    exported = run_config.from_json((out / "config.json").read_text())
    assert exported.model.scan_layers is True
    exported.model.dtype = "float32"
    again = Translator.load(str(out), config=exported)
    assert again.step is None
    assert again.translate(sources[:6], beam_size=1) == got[:6]
    np.testing.assert_allclose(again.score(sources[:5], references[:5]), scores[:5], rtol=1e-5)
    with pytest.raises(ConfigError, match="is an export, of one step"):
        Translator.load(str(out), step=40)


@pytest.mark.slow  # on the module's 40-step run (~50 s to make, cold)
def test_the_docs_python_example_runs_as_written(run):
    # docs/python_api.md's block under its "tested" marker, run as a user pastes it.
    with open(os.path.join(REPO, "docs", "python_api.md"), encoding="utf-8") as f:
        after = f.read().split("<!-- tested: tests/training/test_run_tools.py -->", 1)[1]
    block = []
    for line in after.lstrip("\n").splitlines():
        if line and not line.startswith("    "):
            break
        block.append(line[4:])
    code = "\n".join(block).replace('"/tmp/demo"', repr(run))
    assert "Translator.load(" in code and repr(run) in code
    result = run_command([sys.executable, "-c", code], timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    translations_line, scores_line = result.stdout.strip().splitlines()[-2:]
    translations = ast.literal_eval(translations_line)
    assert len(translations) == 2 and all(isinstance(t, str) and t for t in translations)
    (score,) = [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]\d+)?", scores_line)]
    assert score < 0
