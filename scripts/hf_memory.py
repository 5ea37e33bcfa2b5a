"""Peak host memory of a Hugging Face import and export of a 1B-shaped model: the
figures docs/huggingface.md states, measured on this machine.

    python scripts/hf_memory.py [--size llama3.2-1b] [--dir /tmp/hf_memory]

1. writes a random Llama 3.2 1B-shaped model directory in bfloat16 (2.47 GB; every
   tensor drawn and written one at a time, with a byte-level BPE tokenizer);
2. imports it, in a process of its own, into the stored layout of a ``wus`` run on 8
   CPU devices (``trainer.hf.checkpoint.load``): peak RSS above the process's RSS
   before the import, less the float32 parameters the import places (on CPU the
   devices' memory is the host's), is what the import itself holds;
3. trains one step at learning rate 0 from it with ``python -m trainer`` on one CPU
   device (SGD: no optimizer state to save; on 8 simulated devices each would hold
   the gathered bfloat16 weights, 8 x 2.3 GiB), which writes the checkpoint;
4. exports that checkpoint with ``python -m trainer.export --format hf --dtype
   bfloat16``, in a process of its own: its peak RSS against its RSS after start-up.

Each figure is printed beside the checkpoint's size and its largest tensor's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

GiB = 2**30

_IMPORT = """
import json, os, resource, sys
sys.path.insert(0, {repo!r})
from configs import llama
from trainer.hf import checkpoint
from trainer.training import experiment
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
config = llama.get_config("hf={model}")
exp = experiment.build(config, with_data=False)
before = rss()
done = checkpoint.load("{model}", exp.plan, exp.model.abstract_params, config.model)
placed = sum(a.nbytes for a in done.params.values())
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(dict(before=before, peak=peak, placed=placed, tensors=done.tensors_read)))
"""


# The export command as a user runs it, its RSS read after start-up and at exit.
_EXPORT = """
import atexit, json, resource, runpy, sys
def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS"))
import jax, tensorstore, orbax.checkpoint  # what the command imports before it reads
base = rss()
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
atexit.register(lambda: print(json.dumps(dict(base=base, peak=peak())), file=sys.stderr))
sys.argv = sys.argv[1:]
runpy.run_module("trainer.export", run_name="__main__")
"""


def write_model(directory: str, size: str) -> tuple[int, int]:
    """A random ``size`` model in bfloat16 at ``directory``; (bytes, largest tensor's)."""
    import make_hf_model  # noqa: PLC0415
    import ml_dtypes  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from configs import llama  # noqa: PLC0415
    from trainer.hf import config as hf_config  # noqa: PLC0415
    from trainer.hf import names, safetensors_files  # noqa: PLC0415

    model = llama.get_config(size).model
    model.max_len = 8192
    os.makedirs(directory)
    tokenizer = make_hf_model.make_tokenizer(directory, 512)
    rng = np.random.default_rng(0)
    sizes = []

    def tensors():
        for tensor in names.per_layer(model).values():
            value = (0.02 * rng.standard_normal(tensor.shape, np.float32)).astype(
                ml_dtypes.bfloat16
            )
            sizes.append(value.nbytes)
            yield tensor.name, value

    safetensors_files.write(directory, tensors())
    settings = hf_config.hf_config(
        model, bos_id=tokenizer.bos_token_id, eos_id=tokenizer.eos_token_id, dtype="bfloat16"
    )
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    return sum(sizes), max(sizes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="llama3.2-1b")
    parser.add_argument("--dir", default="/tmp/hf_memory")
    args = parser.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    model, run, out = (os.path.join(args.dir, n) for n in ("model", "run", "export"))
    env = dict(
        os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu"
    )
    start = time.perf_counter()
    total, largest = write_model(model, args.size)
    print(
        f"{args.size}: {total / GiB:.2f} GiB in bfloat16, largest tensor {largest / GiB:.3f} GiB "
        f"(written in {time.perf_counter() - start:.0f}s)"
    )

    start = time.perf_counter()
    script = _IMPORT.format(repo=REPO, model=model)
    imported = json.loads(
        subprocess.run(
            [sys.executable, "-c", script], env=env, check=True, capture_output=True, text=True
        ).stdout.splitlines()[-1]
    )
    held = imported["peak"] - imported["before"] - imported["placed"]
    print(
        f"import ({time.perf_counter() - start:.0f}s, {imported['tensors']} tensors): peak RSS "
        f"{imported['peak'] / GiB:.2f} GiB = {imported['before'] / GiB:.2f} before + "
        f"{imported['placed'] / GiB:.2f} placed (float32, the devices') + {held / GiB:.2f} held "
        f"by the import = {held / largest:.1f}x the largest tensor, "
        f"{held / total:.2f}x the checkpoint"
    )

    start = time.perf_counter()
    train = [
        sys.executable,
        "-m",
        "trainer",
        f"--config=configs/llama.py:text,hf={model}",
        f"--workdir={run}",
        "--cpu_devices=1",
        "--config.num_train_steps=1",
        "--config.optimizer.name=sgd",
        "--config.optimizer.learning_rate=0",
        "--config.optimizer.end_learning_rate=0",
        "--config.global_batch_size=8",
        "--config.data.max_length=32",
        "--config.eval_every_steps=0",
        "--config.steps_per_loop=1",
    ]
    subprocess.run(train, cwd=REPO, env=env, check=True, capture_output=True)
    print(f"one step at learning rate 0 saved a checkpoint ({time.perf_counter() - start:.0f}s)")

    start = time.perf_counter()
    export = [
        sys.executable,
        "-c",
        _EXPORT,
        "trainer.export",
        f"--workdir={run}",
        "--format=hf",
        f"--out={out}",
        "--dtype=bfloat16",
    ]
    result = subprocess.run(export, cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(result.stderr[-3000:])
    figures = json.loads(result.stderr.strip().splitlines()[-1])
    base, peak = figures["base"], figures["peak"]
    print(
        f"export ({time.perf_counter() - start:.0f}s): peak RSS {peak / GiB:.2f} GiB, "
        f"{(peak - base) / GiB:.2f} GiB above start-up = {(peak - base) / largest:.1f}x the "
        f"largest tensor, {(peak - base) / total:.2f}x the checkpoint"
    )
    print(result.stdout.strip())


if __name__ == "__main__":
    main()
