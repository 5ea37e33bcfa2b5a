"""trainer.aot on a small TPU topology (v3:2x2, 8 cores), compiled by libtpu on CPU.

The command runs once as a user runs it (a subprocess writing JSON); the tests
read its report against references computed independently: parameter bytes
from the model's shapes and the plan's layouts, HBM from XLA's memory analysis.
"""

import json
import math
import os
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import REPO, set_compilation_cache, tpu_devices

from configs import transformer_1024
from trainer.analysis import compiled as compiled_lib
from trainer.analysis import costmodel, hlo
from trainer.errors import ConfigError
from trainer.training import experiment

TOPOLOGY = "v3:2x2"


@pytest.fixture(scope="module", autouse=True)
def _without_compilation_cache():
    """Compiles for a topology have no client to read the suite's persistent cache with
    (before the module's compiling fixtures, which share this scope)."""
    was = set_compilation_cache(False)
    yield
    set_compilation_cache(was)


@pytest.fixture(scope="module")
def devices():
    return tpu_devices(TOPOLOGY)


def tiny_config(**overrides):
    config = transformer_1024.get_config("tiny")
    config.steps_per_loop = 2
    for key, value in overrides.items():
        node = config
        *path, leaf = key.split(".")
        for part in path:
            node = node[part]
        node[leaf] = value
    return config


def flash_lm(**overrides):
    """The tiny LM widened for the TPU compiler (d 512, flash attention over rows of 256
    tokens, loops of 2 steps), with ``overrides`` (flattened keys)."""
    from configs import llama

    config = llama.get_config("tiny,synthetic")
    config.update_from_flattened_dict(
        {
            "model.emb_dim": 512,
            "model.attention": "flash",
            "model.max_len": 256,
            "data.max_length": 256,
            "steps_per_loop": 2,
            **overrides,
        }
    )
    return config


@pytest.fixture(scope="module")
def report(devices, tmp_path_factory):
    out = tmp_path_factory.mktemp("aot") / "aot.json"
    cmd = [
        sys.executable,
        "-m",
        "trainer.aot",
        "--config",
        "configs/transformer_1024.py:tiny",
        "--topology",
        TOPOLOGY,
        "--modes",
        "none,wus,fsdp",
        "--json",
        str(out),
        "--hlo",
        str(out.parent / "hlo"),
        "--config.steps_per_loop=2",
    ]
    # A persistent cache configured in the environment: the command must leave it alone
    # (JAX cannot read back what it compiled for a topology, and says so on every hit).
    cache = out.parent / "cache"
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(cache)}
    run = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not cache.exists() or not any(cache.iterdir())
    assert "compilation cache" not in run.stderr
    with open(out) as f:
        return json.load(f), run.stdout, str(out.parent / "hlo")


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_json_schema(report):
    results, _, _ = report
    assert set(results) == {"none", "wus", "fsdp"}
    for r in results.values():
        for key, kind in (
            ("hbm_bytes_per_core", int),
            ("hbm_capacity_bytes", float),
            ("fits", bool),
            ("flops_per_step", float),
            ("xla_optimal_seconds", float),
            ("compile_s", float),
        ):
            assert isinstance(r[key], kind), key
        est = r["est_step_time_s"]
        assert set(est) == {"overlap", "no_overlap", "by_assumption"}
        assert list(est["by_assumption"]) == list(costmodel.ASSUMPTIONS)
        assert est["no_overlap"] == est["by_assumption"]["compiler"]["no_overlap"]
        assert r["groups"].startswith("group = the whole slice (2x2), 4 chips x 2 cores")
        assert r["collectives"]
        for c in r["collectives"]:
            assert {"kind", "dtype", "bytes", "group_size", "async", "emitter", "colors"} <= set(c)
            assert set(c["est_seconds_by_assumption"]) == set(costmodel.ASSUMPTIONS)
        # What libtpu 0.0.52 lets a v3 core's program use ("exceeds available HBM
        # (15.48G)", its message for a larger one), of half a 32 GiB chip.
        assert r["hbm_capacity_bytes"] == 15.48 * 2**30
        assert r["hbm_published_bytes"] == 16 * 2**30
        assert r["fits"]
        assert r["flops_per_step"] > 0
        h = r["hbm_breakdown"]
        total = h["argument"] + h["output"] - h["alias"] + h["temp"] + h["generated_code"]
        assert r["hbm_bytes_per_core"] == total


def _layout_sizes(devices, **overrides):
    """Elements of the wus plan: (stored sharded leaves incl. padding, unsharded leaves)."""
    overrides = {f"optimizer.{k}": v for k, v in overrides.items()}
    exp = experiment.build(tiny_config(**overrides), devices=devices, with_data=False)
    layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "sharded"))
    sharded = sum(math.prod(lay.stored_shape) for lay in layouts if lay.sharded)
    unsharded = sum(math.prod(lay.shape) for lay in layouts if not lay.sharded)
    assert sharded and unsharded
    assert sum(math.prod(lay.shape) for lay in layouts) == exp.model.num_params
    return sharded, unsharded, exp.model.num_params


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_collectives_the_step_should_have(report, devices):
    results, _, _ = report
    sharded, unsharded, num_params = _layout_sizes(devices)
    per_step = {m: [c for c in r["collectives"] if c["per_step"]] for m, r in results.items()}

    def total(mode, kind, dtype):
        return sum(c["bytes"] for c in per_step[mode] if (c["kind"], c["dtype"]) == (kind, dtype))

    # Metric sums and the per-tensor partial sums of the gradient, parameter and
    # update norms ride along in the combined f32 all-reduce: scalars.
    slack = 1024
    # none: every f32 gradient is all-reduced once; no weight moves.
    assert 0 <= total("none", "all-reduce", "f32") - 4 * num_params <= slack
    assert total("none", "all-gather", "bf16") == 0
    # wus: the sharded weights are gathered in bf16 (their whole stored shape), and
    # the v3 back end all-reduces the gradients in f32 instead of reduce-scattering
    # them (reduce-scatter-decomposer): the padded stored leaves plus the rest.
    assert total("wus", "all-gather", "bf16") == 2 * sharded
    assert 0 <= total("wus", "all-reduce", "f32") - 4 * (sharded + unsharded) <= slack
    assert not [c for c in per_step["wus"] if c["kind"] == "reduce-scatter"]
    assert not [c for c in per_step["wus"] if c["dtype"] == "f32" and c["kind"] == "all-gather"]
    for r in per_step.values():
        assert all(c["group_size"] == 8 for c in r)


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_partial_sharding_gets_true_reduce_scatters(devices):
    """Over groups of 4 (not the whole slice) the v3 back end runs real reduce-scatters
    and all-gathers, then sums the shards across the 2 groups."""
    sharded, _, _ = _layout_sizes(devices, shard_group_size=4)
    config = tiny_config(**{"optimizer.shard_group_size": 4})
    r = compiled_lib.analyze(config, devices, "wus", twins=False)

    def total(*key):
        rows = [c for c in r["collectives"] if c["per_step"]]
        return sum(c["bytes"] for c in rows if (c["kind"], c["dtype"], c["group_size"]) == key)

    scatters = total("reduce-scatter", "f32", 4)
    assert scatters > 0.5 * 4 * sharded  # most leaves; a leaf may still all-reduce
    # Scalars (the norms' partial sums) may ride along in an all-reduce over a group.
    assert 0 <= scatters + total("all-reduce", "f32", 4) - 4 * sharded <= 1024
    assert total("all-reduce", "f32", 2) == 4 * sharded // 4
    assert total("all-gather", "bf16", 4) == 2 * sharded


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_memory_win_and_estimates(report):
    results, stdout, _ = report
    none, wus = results["none"], results["wus"]
    # Weights and Adam state live sharded: arguments shrink, whatever the temporaries.
    assert wus["hbm_breakdown"]["argument"] < 0.5 * none["hbm_breakdown"]["argument"]
    for r in results.values():
        est = r["est_step_time_s"]
        assert 0 < est["overlap"] <= est["no_overlap"]
        assert est["overlap"] >= r["est_compute_s"] > 0
        # Compute is XLA's per-instruction roofline: never below the whole-program one.
        assert r["est_compute_s"] == r["xla_optimal_seconds"] >= 0.9 * r["roofline_seconds"]
    assert "wus vs none: HBM/core x" in stdout
    assert "estimated step time" in stdout


@pytest.mark.slow  # 30-65 s of TPU compiles with a cold cache
def test_full_remat_lowers_hbm(devices):
    # Activations must dominate: 3+3 layers, 8 rows of 32 tokens per core.
    hbm = {}
    for remat in ("none", "full"):
        config = tiny_config(
            **{
                "model.remat": remat,
                "model.num_encoder_layers": 3,
                "model.num_decoder_layers": 3,
                "data.max_length": 32,
                "global_batch_size": 64,
            }
        )
        hbm[remat] = compiled_lib.analyze(config, devices, "wus", twins=False)["hbm_bytes_per_core"]
    assert hbm["full"] < 0.95 * hbm["none"]  # 42.2 -> 38.0 MB when written


@pytest.mark.slow  # 30-65 s of TPU compiles with a cold cache
def test_does_not_fit_is_reported(devices):
    # 1.07e9 f32 embedding entries: 4 GiB of weights, 12 GiB with Adam, replicated, and
    # an f32 gradient of 4 GiB. libtpu 0.0.52 refuses it, and compiled again with
    # xla_tpu_no_crash_on_oom (to measure it) answers "Invalid TPU program" on v3: the
    # refusal, with the HBM it asked for and the core's, is the one error line.
    config = tiny_config(
        **{
            "model.vocab_size": 1_048_576,
            "model.emb_dim": 1024,
            "model.qkv_dim": 1024,
            "model.num_heads": 4,
        }
    )
    config.data.vocab_size = 1_048_576
    with pytest.raises(ConfigError) as refused:
        compiled_lib.analyze(config, devices, "none", twins=False)
    message = str(refused.value)
    assert message.startswith("does not fit: ")
    asked = r"required for HLO temporaries \([\d.]+G\) exceeds available HBM \(15.48G\)"
    assert re.search(asked, message)
    assert "\n" not in message


def test_auto_picks_the_fastest_that_fits(devices, monkeypatch):
    config = tiny_config(**{"optimizer.update_sharding": "auto"})
    seen, unrolled = [], []

    def fake_analyze(trial, devs, *, unroll=False):
        opt = trial.optimizer
        key = (opt.update_sharding, opt.shard_group_size, opt.min_shard_bytes)
        seen.append(key)
        unrolled.append(unroll)
        # Faster as the group grows, but the whole slice under wus does not fit.
        step = {"none": 5.0}.get(key[0], 4.0 - (key[1] or 8) / 8)
        est = {"overlap": step, "no_overlap": step, "by_assumption": {"optimistic": est_of(step)}}
        return {
            "mode": key[0],
            "shard_group_size": key[1],
            "min_shard_bytes": key[2],
            "fits": key != ("wus", 0, 4096),
            "hbm_bytes_per_core": 1,
            "hbm_capacity_bytes": 2,
            "est_step_time_s": est,
            "groups": "group = ...",
        }

    def est_of(step):
        return {"overlap": step, "no_overlap": step}

    monkeypatch.setattr(compiled_lib, "analyze", fake_analyze)
    chosen, rows, best = compiled_lib.choose_update_sharding(
        config, devices, log=lambda _: None, unroll=True
    )
    # v3:2x2: a row of 2 chips (4 cores), the whole slice (written 0); fsdp only where
    # wus does not fit; the config's min_shard_bytes.
    assert seen == [("none", 0, 4096), ("wus", 4, 4096), ("wus", 0, 4096), ("fsdp", 0, 4096)]
    assert (chosen.optimizer.update_sharding, chosen.optimizer.shard_group_size) == ("fsdp", 0)
    assert best["mode"] == "fsdp"
    assert unrolled == [True] * 4  # trainer.aot's --unroll reaches every candidate

    monkeypatch.setattr(
        compiled_lib,
        "analyze",
        lambda trial, devs, unroll=False: {
            **fake_analyze(trial, devs),
            "fits": False,
            "hbm_bytes_per_core": 3,
        },
    )
    with pytest.raises(ConfigError, match="no candidate fits"):
        compiled_lib.choose_update_sharding(config, devices, log=lambda _: None)


@pytest.mark.slow  # 30-65 s of TPU compiles with a cold cache
def test_auto_compiles_candidates_on_tpu_and_means_wus_on_cpu(devices):
    config = tiny_config(**{"optimizer.update_sharding": "auto"})
    config.optimizer.auto.update(modes=("wus",), shard_group_sizes=(4,), min_shard_bytes=(4096,))
    lines = []
    chosen, rows, best = compiled_lib.choose_update_sharding(config, devices, log=lines.append)
    assert [r["mode"] for r in rows] == ["none", "wus"]
    assert rows[1]["groups"].startswith("group = torus row x, 2 chips x 2 cores")
    fastest = min(rows, key=lambda r: r["est_step_time_s"]["no_overlap"])
    assert best is fastest and chosen.optimizer.update_sharding == fastest["mode"]
    assert any("chose" in line for line in lines)
    assert any("group = torus row x" in line for line in lines)  # the table says where

    chosen, rows, best = compiled_lib.choose_update_sharding(
        config, jax.devices(), log=lines.append
    )
    assert chosen.optimizer.update_sharding == "wus" and rows == [] and best is None
    assert "no step-time model for cpu devices" in lines[-1]


@pytest.mark.parametrize(
    "name", ["configs/ncf_16.py", pytest.param("configs/resnet50_16.py", marks=pytest.mark.slow)]
)
def test_tasks_build_without_data(name):
    """The full configs build (shapes only) with no dataset prepared."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cfg", os.path.join(REPO, name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.global_batch_size = 8
    exp = experiment.build(config, with_data=False)
    assert exp.task.train_data is None
    logical = jax.eval_shape(exp.plan.to_logical, exp.abstract_state.params)
    leaves = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(logical)}
    if "ncf" in name:
        rows = {k: v.shape[0] for k, v in leaves.items() if "user" in k or "item" in k}
        assert sorted(set(rows.values())) == [26_744, 138_493] and len(rows) == 4
    else:
        assert any(np.prod(v.shape) == 2048 * 1000 for v in leaves.values())


def test_missing_libtpu_is_named_as_such(monkeypatch):
    from jax.experimental import topologies

    def without_libtpu(**_):
        raise RuntimeError("JAX TPU support not installed; cannot generate TPU topology")

    monkeypatch.setattr(topologies, "get_topology_desc", without_libtpu)
    with pytest.raises(ConfigError, match=r"needs libtpu: pip install -e '\.\[tpu\]'"):
        compiled_lib.topology_devices("v3:2x2")


@pytest.mark.slow  # TPU compiles: 40-160 s (shared with the report's other tests)
def test_a_mode_over_the_cores_hbm_is_reported_by_how_much(report, capsys):
    # libtpu 0.0.52 would not build a v3 program over its budget even to measure it
    # (test_does_not_fit_is_reported); a real report with a smaller budget stands in.
    results, _, _ = report
    r = dict(results["none"], fits=False)
    r["hbm_capacity_bytes"] = r["hbm_bytes_per_core"] - 1.5 * 2**30
    from trainer import aot

    aot.report({"none": r})
    assert "does not fit by 1.50 GiB" in capsys.readouterr().out


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_hlo_files_are_the_programs_counted(report):
    results, _, hlo_dir = report
    for mode, r in results.items():
        with open(os.path.join(hlo_dir, f"{mode}.hlo.txt")) as f:
            text = f.read()
        assert text.startswith("HloModule")
        # Counted with plain text search, not our parser: the same collectives.
        ops = [
            line
            for line in text.splitlines()
            if any(f" {k}(" in line or f" {k}-start(" in line for k in hlo.KINDS)
        ]
        assert len(ops) == len(r["collectives"]), mode


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_groups_on_a_v3_row_get_true_reduce_scatters():
    """Transformer-big's layer sizes (2 + 2 layers, 8 heads, a smaller vocabulary) in
    groups of 16, two rows of a v3:4x4 slice: every f32 all-reduce above 1 MiB in the
    wus step is the all-reduce of shards across the groups. Without dropping the
    stored layouts' size-1 leading dims before the reduce-scatter, the attention
    output projections (8 heads over 16 shards: merged, [1, 1024, 1024] scattered on
    dim 1) are all-reduced whole."""
    devices = tpu_devices("v3:4x4")
    config = tiny_config(
        **{
            "model.emb_dim": 1024,
            "model.qkv_dim": 1024,
            "model.num_heads": 8,
            "model.mlp_dim": 4096,
            "model.vocab_size": 8192,
            "optimizer.shard_group_size": 16,
            "optimizer.min_shard_bytes": 65536,
            "global_batch_size": 32,
        }
    )
    config.data.vocab_size = 8192
    r = compiled_lib.analyze(config, devices, "wus", twins=False)
    assert r["groups"].startswith("group = 2 torus rows x side by side along y, 8 chips")
    step = [c for c in r["collectives"] if c["per_step"]]
    scatters = [c for c in step if c["kind"] == "reduce-scatter" and c["group_size"] == 16]
    assert len(scatters) >= 2 * 6 + 1  # every attention and MLP matrix, the embedding
    big = [
        c for c in step if c["kind"] == "all-reduce" and c["dtype"] == "f32" and c["bytes"] > 2**20
    ]
    assert all(c["group_size"] == 2 for c in big), big  # across the 2 groups only
    # Across the groups: the reduced f32 shards, 1/16 of every sharded stored leaf (the
    # back end may pad a scatter's input itself: the embedding's 512 rows a shard).
    exp = experiment.build(config, devices=devices, with_data=False)
    layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "sharded"))
    sharded = 4 * sum(math.prod(lay.stored_shape) for lay in layouts if lay.sharded)
    across = [c for c in step if c["kind"] == "all-reduce" and c["group_size"] == 2]
    assert sum(c["bytes"] for c in across) == sharded // 16
    assert sum(c["bytes"] for c in scatters) >= sharded


@pytest.mark.slow  # 30-65 s of TPU compiles with a cold cache
def test_scanned_layers_keep_the_collectives_per_step_whatever_the_depth():
    """With model.scan_layers, each kind of weight is one stacked tensor: a grouped wus
    step on v3:4x4 (groups of 16, two rows) reduce-scatters and gathers each once,
    however many layers the stacks hold; one module per layer runs one per layer."""
    devices = tpu_devices("v3:4x4")

    def group_collectives(layers, scan):
        config = tiny_config(
            **{
                "model.emb_dim": 512,
                "model.qkv_dim": 512,
                "model.num_heads": 8,
                "model.mlp_dim": 2048,
                "model.vocab_size": 4096,
                "model.num_encoder_layers": layers,
                "model.num_decoder_layers": layers,
                "model.scan_layers": scan,
                "optimizer.shard_group_size": 16,
                "optimizer.min_shard_bytes": 65536,
                "global_batch_size": 32,
            }
        )
        config.data.vocab_size = 4096
        r = compiled_lib.analyze(config, devices, "wus", twins=False)
        assert r["cost_how"] == "program" and r["cost_compile_s"] == 0  # no twins compiled
        kinds = ("reduce-scatter", "all-gather")
        step = [c for c in r["collectives"] if c["per_step"] and c["group_size"] == 16]
        exp = experiment.build(config, devices=devices, with_data=False)
        layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "sharded"))
        return {k: sum(c["kind"] == k for c in step) for k in kinds}, sum(
            lay.sharded for lay in layouts
        )

    counts, stacks = group_collectives(2, True)
    # Encoder: q, k, v, out, wi, wo; decoder: self and cross attention, wi, wo; the table.
    assert stacks == 6 + 10 + 1
    assert counts == {"reduce-scatter": stacks, "all-gather": stacks}
    assert group_collectives(3, True) == (counts, stacks)
    per_layer, leaves = group_collectives(2, False)
    assert leaves == 2 * 16 + 1 and per_layer["reduce-scatter"] > 2 * stacks - 4


@pytest.mark.slow  # 30-65 s of TPU compiles with a cold cache
def test_only_a_slices_share_of_each_gradient_crosses_the_dcn():
    """Two v3:2x2 slices (8 cores each), groups of 4: what crosses the data-center
    network, read from the compiled program (libtpu's megascale sends), is each
    gradient reduced inside its slice first: 1/8 of it per device, in `none` as in
    `wus` - the compiler splits the all-reduce over both slices into an ICI
    reduce-scatter, a DCN all-reduce of the slice's shard and an ICI all-gather (the
    MLPerf multipod order). No full-size gradient crosses."""
    devices = tpu_devices(TOPOLOGY, num_slices=2)
    config = tiny_config(
        **{
            "model.emb_dim": 512,
            "model.qkv_dim": 512,
            "model.num_heads": 8,
            "model.mlp_dim": 2048,
            "model.vocab_size": 4096,
            "optimizer.shard_group_size": 4,
            "optimizer.min_shard_bytes": 65536,
            "global_batch_size": 32,
        }
    )
    config.data.vocab_size = 4096
    config.mesh.dcn_axes.data = 2
    exp = experiment.build(config, devices=devices, with_data=False)
    sizes = [math.prod(p.shape) for p in jax.tree.leaves(exp.model.abstract_params)]
    per_device = 4 * sum(sizes) / 8  # f32, reduced over the 8 devices of a slice first
    for mode in ("none", "wus"):
        r = compiled_lib.analyze(config, devices, mode, twins=False)
        assert r["num_slices"] == 2 and r["devices_per_host"] == 8
        sent = [t for t in r["dcn_transfers"] if t["per_step"]]
        assert {t["kind"] for t in sent} == {"ALL_REDUCE"} and all(t["slices"] == 2 for t in sent)
        assert not any(t["assumed"] for t in r["dcn_transfers"])  # every field as printed
        assert per_device <= sum(t["bytes"] for t in sent) <= 1.05 * per_device, mode
        assert max(t["bytes"] for t in sent) <= 1.05 * 4 * max(sizes) / 8, mode
        # Over 2 slices each device puts its share on the DCN once (2 x 1/2 of it); what
        # runs outside the K-step loop counts once per K = 2 steps.
        once = sum(t["bytes"] for t in r["dcn_transfers"] if not t["per_step"])
        assert r["dcn_bytes_per_host_per_step"] == pytest.approx(
            8 * (sum(t["bytes"] for t in sent) + once / 2)
        )
        assert r["groups"].endswith("in each of 2 slices (DCN between them)")
        est = r["est_step_time_s"]["by_assumption"]
        assert est["compiler"]["dcn"] > 0 and est["pessimistic"]["dcn"] > est["compiler"]["dcn"]


@pytest.mark.slow  # TPU compiles: 40-160 s
def test_per_layer_gathers_every_layer_in_the_scan_and_the_extrapolated_cost_holds(devices):
    """The tiny LM, 4 layers, on v3:2x2: each sharded weight of the stack is gathered
    twice a layer (forward, and again in the backward pass) and its gradient reduced
    once a layer, inside the scans; the per-step figures extrapolated from depths 1
    and 2 are those of the model compiled unrolled."""
    from configs import llama
    from trainer.analysis import step_cost

    config = llama.get_config("tiny,synthetic")
    config.update_from_flattened_dict(
        {
            "model.num_layers": 4,
            "model.emb_dim": 256,
            "model.mlp_dim": 1024,
            "model.head_dim": 64,
            "global_batch_size": 16,
            "steps_per_loop": 2,
            "optimizer.update_sharding": "per_layer",
        }
    )
    # trainer.aot --unroll: the collectives of the program, its figures of the full unroll.
    exact = compiled_lib.analyze(config, devices, unroll=True)
    exp = experiment.build(config, devices=devices, with_data=False)
    layouts = jax.tree.leaves(exp.plan.layouts, is_leaf=lambda x: hasattr(x, "sharded"))
    stacks = jax.tree.leaves(exp.plan.stacks)
    in_scan = sum(lay.sharded and bool(s) for lay, s in zip(layouts, stacks, strict=True))
    whole = sum(lay.sharded and not s for lay, s in zip(layouts, stacks, strict=True))
    assert in_scan == 7  # q, k, v, out, gate, up, down
    gathers = [
        c for c in exact["collectives"] if c["kind"] == "all-gather" and c["dtype"] == "bf16"
    ]
    per_step = sum(c["times_per_step"] for c in gathers)
    assert per_step == 2 * 4 * in_scan + whole
    assert max(c["times_per_step"] for c in gathers) == 4  # one a layer, in a loop
    # The figures extrapolated from depths 1 and 2 are those of the full unroll.
    # (Each compile here is one the test needs: the program once more, for step_cost,
    # and the two twins; the unrolled model was compiled by analyze.)
    assert exact["cost_how"] == "unrolled" and exact["cost_compile_s"] > 0
    compiled = experiment.compile_lowered(experiment.lower_loop(exp, 2), config)
    guess = step_cost.per_step(compiled, config, devices)
    assert guess.how == "extrapolated"
    assert guess.flops == pytest.approx(exact["flops_per_step"], rel=0.01)
    assert guess.bytes_accessed == pytest.approx(exact["bytes_accessed_per_step"], rel=0.05)
    assert guess.optimal_seconds == pytest.approx(exact["xla_optimal_seconds"], rel=0.05)
    # Without its twins: XLA's figures as compiled, one layer counted.
    alone = step_cost.per_step(compiled, config, devices, twins=False)
    assert alone.how == "program" and alone.compile_s == 0
    assert alone.flops < 0.5 * guess.flops


def test_each_mode_is_written_as_soon_as_it_is_done(tmp_path, monkeypatch, devices):
    """A run stopped in its second mode (a 25-minute v6e compile, say) keeps the first
    mode's JSON and HLO, and the second's HLO from before its twins; ``--unroll``
    reaches every mode's figures."""
    from trainer import aot

    calls = []

    def analyze(config, devs, mode, *, unroll=False, on_program=None):
        calls.append((mode, unroll))
        on_program(f"HloModule {mode}\n")  # the program, compiled
        if mode == "wus":
            raise KeyboardInterrupt  # stopped while its twins compile
        return {
            "mode": mode,
            "hbm_bytes_per_core": 1,
            "fits": True,
            "est_step_time_s": {"by_assumption": {"compiler": {"no_overlap": 0.5}}},
        }

    monkeypatch.setattr(compiled_lib, "analyze", analyze)
    json_out, hlo_dir = tmp_path / "aot.json", tmp_path / "hlo"
    hlo_dir.mkdir()
    with pytest.raises(KeyboardInterrupt):
        aot.compile_modes(
            tiny_config(), devices, ["none", "wus", "fsdp"], json_out, hlo_dir, unroll=True
        )
    assert calls == [("none", True), ("wus", True)]
    assert set(json.loads(json_out.read_text())) == {"none"}
    assert json.loads(json_out.read_text())["none"]["hbm_bytes_per_core"] == 1
    assert (hlo_dir / "none.hlo.txt").read_text() == "HloModule none\n"
    assert (hlo_dir / "wus.hlo.txt").read_text() == "HloModule wus\n"


@pytest.mark.slow  # TPU compiles: the program and its two twins, 2-4 min
def test_the_step_counts_every_layers_matmuls_and_flash_backward():
    """The tiny LM widened (4 layers, d 512, flash attention, full remat) under
    per_layer on v5e:2x2: the program's matmul FLOPs are the model's worked out from
    its shapes, every layer's forward, recomputed forward and backward, and the twins'
    FLOPs are not below them; flash attention's backward kernels, which XLA counts as
    free, are counted for every layer from their shapes."""
    from models import decoder
    from trainer.analysis import step_cost
    from trainer.tasks import language_model

    devices = tpu_devices("v5e:2x2")
    config = flash_lm(
        **{
            "model.num_layers": 4,
            "model.mlp_dim": 2048,
            "model.head_dim": 64,
            "model.remat": "full",
            "global_batch_size": 16,
            "optimizer.update_sharding": "per_layer",
        }
    )
    exp = experiment.build(config, devices=devices, with_data=False)
    compiled = experiment.compile_lowered(experiment.lower_loop(exp, 2), config)
    cost = step_cost.per_step(compiled, config, devices)
    assert cost.how == "extrapolated"
    # The reference, from the model's shapes: a device's 4 rows of 256 tokens go through
    # every projection and the output table forward (2 FLOPs a parameter a token) and
    # backward (twice that), and through the layers once more, recomputed (full remat),
    # all but each layer's MLP output projection: its result, the layer's output, is
    # not what the layer's backward pass needs (the scan saved the next layer's input),
    # so the compiler drops its recomputation.
    model = language_model.model_config(config)
    tokens = 16 // 4 * 256
    table = model.vocab_size * model.emb_dim
    layers = decoder.matmul_params(model) - table
    down = model.num_layers * model.mlp_dim * model.emb_dim
    reference = 2 * tokens * (3 * (layers + table) + layers - down)
    assert cost.dot_flops == pytest.approx(reference, rel=0.01)
    # The twins' figure, extrapolated from depths 1 and 2, must not fall below the
    # program's own matmuls (unrolled, remat without prevent_cse loses some of them:
    # step_cost.py); where it does, the estimate adds the shortfall at peak.
    assert cost.flops >= cost.dot_flops
    assert cost.matmul_shortfall_flops == 0
    # Flash backward: per layer a dK/dV kernel of 4 and a dQ kernel of 3 [256 x 256]
    # score matmuls for each of a device's 4 rows x heads, every one of the 4 layers.
    heads = model.num_heads
    square = 2 * 4 * heads * 256 * 256 * model.head_dim
    assert cost.uncosted_flops == 4 * (4 + 3) * square


def test_hbm_budget_is_libtpus():
    """libtpu 0.0.52 refuses a larger program with "exceeds available HBM (31.24G)" on
    v6e (whose published "32 GB" are 29.8 GiB), 15.75G on v5e: the fit check's figure."""
    assert compiled_lib.compiler_hbm_budget(tpu_devices("v6e:2x2")[0]) == 31.24 * 2**30
    assert compiled_lib.compiler_hbm_budget(tpu_devices("v5e:2x2")[0]) == 15.75 * 2**30
    assert compiled_lib.compiler_hbm_budget(jax.devices()[0]) is None  # a CPU


def test_unrolled_figures_are_not_asked_of_no_figures():
    # twins=False takes the program's own figures, unroll=True compiles the whole model:
    # asked together, one would be dropped in silence.
    from trainer.analysis import step_cost

    with pytest.raises(ValueError, match="unroll=True"):
        step_cost.per_step(None, tiny_config(), [], unroll=True, twins=False)


@pytest.mark.slow  # two TPU compiles, about 1 min
@pytest.mark.parametrize("mode", ["per_layer", "wus"])
def test_flash_attention_runs_on_each_devices_share_of_the_heads(mode):
    """A Pallas kernel cannot be split by XLA's partitioner: under tensor parallelism
    (v5p:2x2x1 as 2 replicas x 2 ways of heads) every flash kernel of the compiled
    step, forward and backward, takes a device's own rows and half of the heads."""
    from trainer.analysis import flops

    devices = tpu_devices("v5p:2x2x1")
    config = flash_lm(
        **{
            "model.num_layers": 2,
            "model.mlp_dim": 1024,
            "model.num_heads": 8,
            "model.num_kv_heads": 4,
            "model.head_dim": 128,
            "global_batch_size": 8,
            "mesh.axes.data": 2,
            "mesh.axes.model": 2,
            "optimizer.update_sharding": mode,
        }
    )
    exp = experiment.build(config, devices=devices, with_data=False)
    text = experiment.compile_lowered(experiment.lower_loop(exp, 2), config).as_text()
    kernels = [
        (flops.instruction(line).name, flops.dims(flops.instruction(line).type_text))
        for line in text.splitlines()
        if flops.attention_kernel(line) is not None
    ]
    names = {name.rsplit(".", 1)[0] for name, _ in kernels}
    assert any(n.startswith("flash_attention") for n in names), names
    assert any(n.startswith("flash_mha_bwd_dkv") for n in names), names
    assert any(n.startswith("flash_mha_bwd_dq") for n in names), names
    # [rows, heads, length, head_dim]: a replica's 4 rows, 8 / 2 heads.
    assert {tuple(shape) for _, shape in kernels} == {(4, 4, 256, 128)}


@pytest.mark.slow  # two TPU compiles: ~40 s
def test_a_whole_slice_reduces_each_layers_gradient_ring_by_ring(monkeypatch):
    """per_layer over a whole v5p:4x4x8 slice (rings of 4, 4 and 8 chips, each closed):
    asked for one reduce-scatter over the 128 chips, libtpu runs an all-reduce of
    each layer's whole gradient and a slice; asked ring by ring
    (collectives.reduce_scatter with mesh.data_rings), it runs true reduce-scatters,
    each within one whole torus ring, and the compiled program's collectives cost less."""
    from trainer.parallel import mesh as mesh_lib

    devices = tpu_devices("v5p:4x4x8")
    config = flash_lm(
        **{
            "optimizer.update_sharding": "per_layer",
            "global_batch_size": 128,
            "model.emb_dim": 1024,  # 8 rows a chip: a TPU tile's, as collectives needs
            "model.mlp_dim": 4096,
            "model.num_heads": 8,
            "model.num_kv_heads": 8,
            "model.head_dim": 128,
        }
    )
    programs = []
    rings = compiled_lib.analyze(config, devices, twins=False, on_program=programs.append)
    mesh = mesh_lib.make_mesh(dict(config.mesh.axes), devices=devices)
    assert mesh_lib.data_rings(mesh) == (4, 4, 8)
    chips = [d.coords[:3] for d in mesh.devices.flat]  # partition id -> chip

    def in_layers(kind):  # in the layers' scan, inside the K-step loop
        every = hlo.collectives(programs[-1], len(devices))
        return [c for c in every if c.loop_depth == 2 and c.kind == kind]

    def whole_slice_all_reduces():  # of at least a layer's smallest gathered weight
        smallest = min(c.result_bytes for c in in_layers("all-gather") if c.dtype == "bf16")
        return [
            c
            for c in in_layers("all-reduce")
            if c.group_size == len(devices) and c.result_bytes >= smallest
        ]

    scatters = in_layers("reduce-scatter")
    assert {c.group_size for c in scatters} == {4, 8}
    for c in scatters:  # one whole torus ring: 4 chips along x or y, or 8 along z
        where = [chips[p] for p in c.group]
        varies = [i for i in range(3) if len({w[i] for w in where}) > 1]
        assert len(varies) == 1 and len(where) == (4, 4, 8)[varies[0]], where
    assert not whole_slice_all_reduces()

    monkeypatch.setattr(mesh_lib, "data_rings", lambda mesh: ())  # one reduce-scatter
    programs.clear()
    one = compiled_lib.analyze(config, devices, twins=False, on_program=programs.append)
    assert whole_slice_all_reduces()  # libtpu's all-reduce of a whole gradient, and a slice

    def collective_s(report):
        return report["est_step_time_s"]["by_assumption"]["compiler"]["collectives"]

    assert collective_s(rings) < collective_s(one)
