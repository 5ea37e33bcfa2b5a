"""Our estimates held against measurements no one here made: MaxText's published MFU
(v5e-256, v5p-128) and the weight-update-sharding paper's Transformer-big step times.

  python scripts/published.py --out /tmp/published [--force] [--only v5e-32b,...] [--timeout S]

Each point is compiled with ``python -m trainer.aot`` on the topology it was measured
on (one at a time: a 128B model on 256 chips takes minutes and GiBs; a point not done
in ``--timeout`` seconds is reported as such), its JSON and optimized HLO kept in
``--out`` (re-runs reuse them unless ``--force``); then the Markdown table of
docs/aot.md is printed. MaxText's points run ``per_layer`` over the whole slice, as MaxText's FSDP
does (``ici_fsdp_parallelism=-1``: each layer's weights gathered in the scan); ``none``,
``wus`` and ``fsdp`` cannot hold these models (``--modes auto`` on one of them says so
and why). Nothing here is fitted to the measurements: the estimate is the cost
model's (trainer/analysis/costmodel.py) on the compiled program.

MFU is MaxText's: model FLOPs a chip a step as its code counted them when the tables
were measured (``6 N s B + 12 L H d s^2 B``, attention not halved for causality, N
all parameters with the tied table once; MaxText/train.py at commit e47fa1b5) over
the step time and the chip's peak (197 TFLOP/s v5e, 459 v5p: Google Cloud's TPU
pages; every published TFLOP/s and MFU pair agrees with them).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from configs import maxtext  # noqa: E402
from trainer.parallel import hardware  # noqa: E402

MODE = "per_layer"  # MaxText's FSDP
# name: (variant, topology, slices)
POINTS = {
    "v5e-16b": ("v5e-16b", "v5e:16x16", 1),
    "v5e-32b": ("v5e-32b", "v5e:16x16", 1),
    "v5e-64b": ("v5e-64b", "v5e:16x16", 1),
    "v5e-128b": ("v5e-128b", "v5e:16x16", 1),
    "v5p-32b": ("v5p-32b", "v5p:4x4x4", 1),
    "v5p-64b": ("v5p-64b", "v5p:4x4x4", 1),
    "v5p-32b-2slices": ("v5p-32b", "v5p:4x4x4", 2),
}
# Transformer-big on 2048 v3 cores, the paper's measurement (section 6.1: 46.5 ms per
# step without weight-update sharding, 25.6 ms with it).
PAPER = ("configs/transformer_1024.py:synthetic", "v3:32x32", {"none": 46.5e-3, "wus": 25.6e-3})


def maxtext_flops(variant: str, slices: int) -> float:
    """Model FLOPs a chip a step, as MaxText counted them in Oct-Dec 2023."""
    config = maxtext.get_config(f"{variant},slices={slices}")
    m = config.model
    length = config.data.max_length
    chips = maxtext.RUNS[variant][1] * slices
    rows = config.global_batch_size / chips
    from models import decoder  # noqa: PLC0415
    from trainer.tasks import language_model  # noqa: PLC0415

    params = decoder.param_count(language_model.model_config(config))
    attention = 12 * m.num_layers * m.num_heads * m.head_dim * length**2 * rows
    return 6 * params * length * rows + attention


def compile_point(
    out: str,
    name: str,
    config: str,
    topology: str,
    slices: int,
    modes: str,
    force: bool,
    timeout: float | None = None,
) -> dict:
    path = os.path.join(out, f"{name}.json")
    if force or not os.path.exists(path):
        command = [
            sys.executable,
            "-m",
            "trainer.aot",
            f"--config={config}",
            f"--topology={topology}",
            f"--modes={modes}",
            f"--json={path}",
            f"--hlo={os.path.join(out, name + '-hlo')}",  # the programs, for anyone to recount
        ]
        if slices > 1:
            command.append(f"--num_slices={slices}")
        log = os.path.join(out, f"{name}.log")
        with open(log, "w") as f:
            try:
                result = subprocess.run(
                    command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=timeout
                )
            except subprocess.TimeoutExpired:
                return {"error": f"not compiled in {timeout:.0f} s (the log: {log})"}
        if result.returncode:
            return {"error": _last_error(log)}
    with open(path) as f:
        return json.load(f)


def _last_error(log: str) -> str:
    """The compiler's last word in ``log``: the line of the exception that ended it."""
    with open(log, errors="replace") as f:
        lines = [line.strip() for line in f if "Error: " in line or line.startswith("error:")]
    return " ".join(lines[-1].split())[:300] if lines else f"see {log}"


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f}"


def table(results: dict) -> str:
    rows = [
        "| point | MaxText measured MFU | ours: mode | HBM/chip GiB (of), the compiler "
        "| est. step s, overlap / none | est. MFU, overlap / none "
        "| speed est. / measured, overlap / none |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if name == "paper":
            continue
        variant, topology, slices = POINTS[name]
        measured = maxtext.measured_mfu(variant, slices)
        if "error" in r:
            rows.append(f"| {name} | {measured:.2%} | {MODE}: did not compile: {r['error']} |")
            continue
        chosen = r[MODE]
        est = chosen["est_step_time_s"]
        flops = maxtext_flops(variant, slices)
        chip = hardware.ACCELERATORS[topology.split(":")[0]]
        peak = chip.peak_flops(1)  # bf16 a chip, Google Cloud's TPU pages (hardware.py)
        # What libtpu let the program use (its budget), else the published figure.
        capacity = chosen.get("hbm_capacity_bytes") or chip.hbm_bytes(1)
        mfu = {k: flops / (est[k] * peak) for k in ("overlap", "no_overlap")}
        rows.append(
            f"| {name} | {measured:.2%} | {chosen['mode']} | "
            f"{_gib(chosen['hbm_bytes_per_core'])} ({_gib(capacity)}), "
            f"{'refused' if chosen['compiler_oom'] else 'accepted'} | "
            f"{est['overlap']:.2f} / {est['no_overlap']:.2f} | "
            f"{mfu['overlap']:.1%} / {mfu['no_overlap']:.1%} | "
            f"{mfu['overlap'] / measured:.2f} / {mfu['no_overlap'] / measured:.2f} |"
        )
    if "paper" in results:
        for mode, seconds in PAPER[2].items():
            est = results["paper"][mode]["est_step_time_s"]
            rows.append(
                f"| Transformer-big, v3:32x32, {mode} | {seconds * 1e3:.1f} ms measured | {mode} | "
                f"{_gib(results['paper'][mode]['hbm_bytes_per_core'])} | "
                f"{est['overlap'] * 1e3:.1f} / {est['no_overlap'] * 1e3:.1f} ms | | "
                f"{seconds / est['overlap']:.2f} / {seconds / est['no_overlap']:.2f} |"
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--only", default="", help="comma-separated point names (and paper)")
    parser.add_argument("--timeout", type=float, default=2700, help="seconds a point may take")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    wanted = [n for n in args.only.split(",") if n] or [*POINTS, "paper"]
    results = {}
    for name in wanted:
        if name == "paper":
            config, topology, _ = PAPER
            results["paper"] = compile_point(
                args.out, "paper", config, topology, 1, "none,wus", args.force, args.timeout
            )
        else:
            variant, topology, slices = POINTS[name]
            config = f"configs/maxtext.py:{variant},slices={slices}"
            results[name] = compile_point(
                args.out, name, config, topology, slices, MODE, args.force, args.timeout
            )
        print(f"{name}: {'failed' if 'error' in results[name] else 'compiled'}", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
