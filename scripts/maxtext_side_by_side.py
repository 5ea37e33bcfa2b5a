"""The same decoder trained by MaxText and by this project on this machine's CPUs, side by
side: step time, tokens/s, peak RSS, compile time, parameter counts (asserted equal).

    python scripts/maxtext_side_by_side.py --rounds 3 --out /tmp/side_by_side

MaxText 0.2.5 is installed on first use into its own Python 3.12 venv
(``--maxtext_venv``, ``pip install 'maxtext[tpu]==0.2.5'``: about 2.9 GB; it resolves
the jax, jaxlib, flax and libtpu this project pins). Each round runs MaxText and each of
our modes once, back to back, the order reversed every other round, each a fresh
process with no compilation cache on 8 simulated CPU devices; the ratios are taken
within a round (the two runs next to each other), and their median over the rounds is
reported with the load average before and after every run.

The model, as ``shared/peers/maxtext/run_one.sh`` measured it: a Llama-2 block (RMSNorm,
RoPE, SwiGLU, grouped-query attention), untied tables, bf16 activations (``--dtype``)
on f32 master weights, full remat, one scan over the layers, AdamW (b2 0.95, eps 1e-8,
weight decay 0.1, clipping at 1.0), random tokens; MaxText's FSDP over the 8 devices.

* ``tiny``: 4 layers, d 128, 4/2 heads of 32, MLP 512, vocab 4,096, 16 rows of 128;
* ``64m``: 8 layers, d 512, 8/4 heads of 64, MLP 2,048, vocab 32,000, 8 rows of 128.

Step time: MaxText's is the wall time between consecutive ``completed step`` lines from
step 2 on (its own ``seconds`` field times dispatch to dispatch); ours is a compiled
loop's wall time over its steps, the first loop left out. Peak RSS: the process's
``ru_maxrss`` (``os.wait4``); and its peak while training: the kernel's high-water
mark (``VmHWM``, read every 20 ms) at the last step's line, before the end of the run.
The two differ where a run does more after its last step: ours writes its final
checkpoint (``checkpoint_every_steps=0`` saves at the end all the same), MaxText's runs
here do not (``enable_checkpointing=false``). Compiles: JAX's ``Finished XLA
compilation`` lines (``JAX_LOG_COMPILES=1``): the training step's, and all of a run's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAXTEXT = "maxtext[tpu]==0.2.5"
SIZES = {
    "tiny": dict(
        layers=4,
        emb=128,
        heads=4,
        kv_heads=2,
        head_dim=32,
        mlp=512,
        vocab=4096,
        length=128,
        batch=16,
        steps=15,
        loop=5,
    ),
    "64m": dict(
        layers=8,
        emb=512,
        heads=8,
        kv_heads=4,
        head_dim=64,
        mlp=2048,
        vocab=32000,
        length=128,
        batch=8,
        steps=6,
        loop=2,
    ),
}
# MaxText's parameter count, by its own model code (run in its venv).
_COUNT = """
import sys, jax
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, model_creation_utils
config = pyconfig.initialize(sys.argv)
_, model = model_creation_utils.create_nnx_abstract_model(
    config, maxtext_utils.get_mesh_from_config(config))
print("PARAMETERS", sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))
"""


def python312() -> str:
    """A Python 3.12 interpreter: python3.12 on the PATH, or pyenv's."""
    found = shutil.which("python3.12")
    if found:
        return found
    try:
        root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise SystemExit("error: no Python 3.12 (python3.12 on the PATH, or pyenv)") from None
    versions = os.path.join(root.stdout.strip(), "versions")
    for name in sorted(os.listdir(versions), reverse=True):
        if name.startswith("3.12"):
            return os.path.join(versions, name, "bin", "python")
    raise SystemExit("error: pyenv has no Python 3.12 (pyenv install 3.12)")


def maxtext_python(venv: str) -> str:
    """The MaxText venv's Python, installing MaxText there first if it is missing."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python):
        return python
    print(f"installing {MAXTEXT} into {venv} (about 2.9 GB, minutes) ...", flush=True)
    subprocess.run([python312(), "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--upgrade", "pip"], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", MAXTEXT], check=True)
    return python


def maxtext_base(python: str) -> str:
    code = "import maxtext, os; print(os.path.join(os.path.dirname(maxtext.__file__), "
    code += "'configs', 'base.yml'))"
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def maxtext_args(size: dict, dtype: str, workdir: str, steps: int) -> list[str]:
    return [
        "run_name=r",
        f"base_output_directory={workdir}/out",
        "hardware=cpu",
        "skip_jax_distributed_system=true",
        f"jax_cache_dir={workdir}/jax_cache",
        "dataset_type=synthetic",
        f"steps={steps}",
        "enable_checkpointing=false",
        "decoder_block=llama2",
        f"base_num_decoder_layers={size['layers']}",
        f"base_emb_dim={size['emb']}",
        f"base_num_query_heads={size['heads']}",
        f"base_num_kv_heads={size['kv_heads']}",
        f"head_dim={size['head_dim']}",
        f"base_mlp_dim={size['mlp']}",
        f"vocab_size={size['vocab']}",
        f"max_target_length={size['length']}",
        f"per_device_batch_size={size['batch'] // 8}",
        "remat_policy=full",
        "scan_layers=true",
        "attention=dot_product",
        f"dtype={dtype}",
        "weight_dtype=float32",
        "enable_dropout=false",
        "logits_via_embedding=false",
        "ici_fsdp_parallelism=-1",
        "opt_type=adamw",
        "adam_b1=0.9",
        "adam_b2=0.95",
        "adam_eps=1e-8",
        "adam_weight_decay=0.1",
        "gradient_clipping_threshold=1.0",
        "enable_tensorboard=false",
        "log_period=1000",
        "rope_max_timescale=10000",
    ]


def our_args(size: dict, dtype: str, workdir: str, mode: str) -> list[str]:
    config = {
        "model.num_layers": size["layers"],
        "model.emb_dim": size["emb"],
        "model.num_heads": size["heads"],
        "model.num_kv_heads": size["kv_heads"],
        "model.head_dim": size["head_dim"],
        "model.mlp_dim": size["mlp"],
        "model.vocab_size": size["vocab"],
        "data.vocab_size": size["vocab"],
        "model.max_len": size["length"],
        "data.max_length": size["length"],
        "model.tie_embeddings": "false",
        "model.remat": "full",
        "model.rope_theta": 10000,
        "model.dtype": dtype,
        # MaxText's logits_dot_in_fp32: false (its default): the output projection's
        # product in the activations' dtype, cast to float32 after (cast_logits_to_fp32).
        "model.logits_dtype": dtype,
        "model.param_dtype": "float32",
        "global_batch_size": size["batch"],
        "num_train_steps": size["steps"],
        "steps_per_loop": size["loop"],
        "log_every_steps": size["loop"],
        "eval_every_steps": 0,
        "checkpoint_every_steps": 0,
        "eval_at_start": "false",
        "optimizer.update_sharding": mode,
        "optimizer.eps": 1e-8,
        "optimizer.b2": 0.95,
        "optimizer.weight_decay": 0.1,
        "optimizer.clip_norm": 1.0,
    }
    return [
        "-m",
        "trainer",
        "--config=configs/llama.py:synthetic",
        "--cpu_devices=8",
        f"--workdir={workdir}/w",
        *(f"--config.{k}={v}" for k, v in config.items()),
    ]


def run(command: list[str], cwd: str, env: dict, log: str) -> dict:
    """Runs ``command``; returns its stamped output lines, peak RSS and the load."""
    load_before = os.getloadavg()[0]
    start = time.monotonic()
    process = subprocess.Popen(
        command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines, high_water = [], []  # (seconds since the start, VmHWM GiB)
    done = threading.Event()  # the output ended (process.poll() here would reap it)

    def watch():
        while not done.is_set():
            with contextlib.suppress(OSError), open(f"/proc/{process.pid}/status") as f:
                for row in f:
                    if row.startswith("VmHWM:"):
                        stamp = time.monotonic() - start
                        high_water.append((stamp, int(row.split()[1]) / 2**20))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with open(log, "w") as f:
        for line in process.stdout:
            stamp = time.monotonic() - start
            lines.append((stamp, line.rstrip("\n")))
            f.write(f"{stamp:9.3f} {line}")
    done.set()
    watcher.join()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"error: {' '.join(command[:4])} ... failed; its output is in {log}")
    return dict(
        lines=lines,
        high_water=high_water,
        wall_s=time.monotonic() - start,
        peak_rss_gib=usage.ru_maxrss / 2**20,
        load=(load_before, os.getloadavg()[0]),
    )


def training_peak(out: dict, last_step: float) -> float:
    """The process's peak RSS (GiB) up to ``last_step`` seconds: its last step's line."""
    return max(gib for stamp, gib in out["high_water"] if stamp <= last_step)


def compiles(lines) -> tuple[float, float]:
    """(the training step's XLA compile, all XLA compiles), seconds."""
    found = [
        (m.group(1), float(m.group(2)))
        for _, line in lines
        if (m := re.search(r"Finished XLA compilation of jit\((\S+?)\) in ([\d.]+) sec", line))
    ]
    train = [s for name, s in found if name in ("train_step", "train_loop")]
    return (max(train) if train else float("nan")), sum(s for _, s in found)


def measure_maxtext(python: str, base: str, size: dict, dtype: str, log: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="maxtext-")
    try:
        env = _env()
        out = run(
            [
                python,
                "-m",
                "maxtext.trainers.pre_train.train",
                base,
                *maxtext_args(size, dtype, workdir, size["steps"]),
            ],
            workdir,
            env,
            log,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    steps = [
        (int(m.group(1)), stamp)
        for stamp, line in out["lines"]
        if (m := re.search(r"completed step: (\d+), seconds:", line))
    ]
    deltas = [(n, t - steps[i - 1][1]) for i, (n, t) in enumerate(steps) if i > 0 and n >= 2]
    out["step_s"] = statistics.median(d for _, d in deltas)
    out["train_rss_gib"] = training_peak(out, steps[-1][1])
    out["train_compile_s"], out["all_compiles_s"] = compiles(out["lines"])
    return out


def measure_ours(size: dict, dtype: str, mode: str, log: str) -> dict:
    workdir = tempfile.mkdtemp(prefix="ours-")
    try:
        out = run([sys.executable, *our_args(size, dtype, workdir, mode)], REPO, _env(), log)
        with open(os.path.join(workdir, "w", "metrics.jsonl")) as f:
            windows = [json.loads(line)["step_time_s"] for line in f]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out["step_s"] = statistics.median(windows[1:])
    last = max(t for t, line in out["lines"] if re.match(r"step +\d+/\d+ \|", line))
    out["train_rss_gib"] = training_peak(out, last)
    out["train_compile_s"], out["all_compiles_s"] = compiles(out["lines"])
    params = [
        m.group(1)
        for _, line in out["lines"]
        if (m := re.search(r"model decoder: ([\d,]+) parameters", line))
    ]
    out["params"] = int(params[0].replace(",", ""))
    return out


def maxtext_params(python: str, base: str, size: dict, dtype: str) -> int:
    workdir = tempfile.mkdtemp(prefix="maxtext-count-")
    try:
        result = subprocess.run(
            [python, "-c", _COUNT, base, *maxtext_args(size, dtype, workdir, 1)],
            env=_env(),
            capture_output=True,
            text=True,
            check=True,
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return int(re.search(r"PARAMETERS (\d+)", result.stdout).group(1))


def _env() -> dict:
    env = {
        k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")
    }
    env.update(
        XLA_FLAGS="--xla_force_host_platform_device_count=8",
        JAX_PLATFORMS="cpu",
        JAX_LOG_COMPILES="1",
        PYTHONPATH=REPO,
    )
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,64m", help=f"of {sorted(SIZES)}")
    parser.add_argument("--modes", default="wus,fsdp,per_layer", help="our update-sharding modes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument(
        "--maxtext_venv", default=os.path.expanduser("~/.cache/wus-trainer/maxtext-0.2.5")
    )
    parser.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "side_by_side"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    python = maxtext_python(args.maxtext_venv)
    base = maxtext_base(python)
    modes = args.modes.split(",")
    print(f"{os.cpu_count()} CPUs; load {os.getloadavg()}; logs in {args.out}", flush=True)
    results = {}
    for size_name in args.sizes.split(","):
        size = SIZES[size_name]
        theirs = maxtext_params(python, base, size, args.dtype)
        rounds = []
        for r in range(args.rounds):
            order = ["maxtext", *modes]
            order = order if r % 2 == 0 else order[::-1]
            measured = {}
            for who in order:
                log = os.path.join(args.out, f"{size_name}-{who}-{r}.log")
                if who == "maxtext":
                    measured[who] = measure_maxtext(python, base, size, args.dtype, log)
                else:
                    measured[who] = measure_ours(size, args.dtype, who, log)
                    if measured[who]["params"] != theirs:
                        raise SystemExit(
                            f"error: {size_name}: {measured[who]['params']:,} parameters here, "
                            f"{theirs:,} in MaxText: not the same model"
                        )
                m = measured[who]
                print(
                    f"{size_name} round {r} {who:9s}: step {m['step_s']:.3f} s, peak RSS "
                    f"{m['peak_rss_gib']:.2f} GiB ({m['train_rss_gib']:.2f} training), "
                    f"train-step compile {m['train_compile_s']:.1f} s "
                    f"(all {m['all_compiles_s']:.1f} s), wall {m['wall_s']:.0f} s, load "
                    f"{m['load'][0]:.1f} -> {m['load'][1]:.1f}",
                    flush=True,
                )
                del m["lines"], m["high_water"]
            rounds.append(measured)
        results[size_name] = dict(params=theirs, rounds=rounds)
        _report(size_name, size, theirs, rounds, modes)
    with open(os.path.join(args.out, "side_by_side.json"), "w") as f:
        json.dump(results, f, indent=1)


def _report(size_name: str, size: dict, params: int, rounds: list[dict], modes: list[str]) -> None:
    tokens = size["batch"] * size["length"]
    mt = [r["maxtext"] for r in rounds]
    print(f"\n{size_name}: {params:,} parameters on both; {len(rounds)} rounds, medians")
    print(
        "| who | step s | tokens/s | step / MaxText's | peak RSS GiB | RSS / MaxText's "
        "| peak RSS training GiB | training RSS / MaxText's | train-step compile s "
        "| all compiles s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = [("MaxText", "maxtext")] + [(f"ours, {m}", m) for m in modes]
    for label, who in rows:
        runs = [r[who] for r in rounds]

        def median(key, runs=runs):
            return statistics.median(x[key] for x in runs)

        def ratio(key, runs=runs):  # within each round, then the median
            return statistics.median(x[key] / y[key] for x, y in zip(runs, mt, strict=True))

        step = median("step_s")
        print(
            f"| {label} | {step:.3f} | {tokens / step:,.0f} | {ratio('step_s'):.2f}x | "
            f"{median('peak_rss_gib'):.2f} | {ratio('peak_rss_gib'):.2f}x | "
            f"{median('train_rss_gib'):.2f} | {ratio('train_rss_gib'):.2f}x | "
            f"{median('train_compile_s'):.1f} | {median('all_compiles_s'):.1f} |"
        )
    print(flush=True)


if __name__ == "__main__":
    main()
