"""Xu et al. 2020, Table 1, reproduced on the real TPU compiler: one command.

  python scripts/paper_table1.py --out /tmp/table1 [--force] [--only NAME,...]

Compiles each setup with ``python -m trainer.aot`` (one at a time: the big ones
take minutes and several GiB of RAM), keeps each JSON in ``--out`` (re-runs
reuse them unless ``--force``), then prints the README's Markdown table: per
setup, ``none`` vs ``wus`` HBM per core and estimated step time, beside the
paper's published figures, under every link assumption of trainer/analysis/costmodel.py and
with ``update_sharding=auto``; then where the time goes, mode by mode; and Adam vs
SGD per-core HBM under ``wus``. Also the pods people train on today: Transformer-big
on 1024 v5p chips and on a v6e pod.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# XLA's async collective flags as MaxText sets them (only these two change this libtpu's
# schedule; the others are on by default): all-gathers overlap the previous matmul.
_ASYNC = (
    "--config.compiler_options=xla_enable_async_all_gather=true "
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
)
# Transformer-big's figures from the model compiled unrolled, not from twins of depths
# 1 and 2: its layers do not all cost alike (a layer's cost falls with the depth around
# it), so the twins put wus's XLA seconds on v3:32x32 27% above the unrolled model's,
# and the unrolled compile (58 s) is quicker than the three twins (82 s; docs/aot.md).
_EXACT = "--unroll"
# On 2048 cores auto weighs a row, two rows and the whole slice (each candidate is a
# full compile; the groupings in between were never faster).
_AUTO_2048 = "--config.optimizer.auto.shard_group_sizes=(64,128,0)"
# name: (config, topology, extra flags, modes, the paper's figure for wus/none step time).
# The Table 1 rows compile none, wus (as configured) and auto (which weighs none and
# wus on every ring-aligned grouping); the pods people train on today compare none,
# wus and fsdp; the *_whole and *_sgd rows compile only wus, for the comparisons below.
_FIG11 = "small (Fig. 11; no number in the text)"
_TABLE1 = "none,wus,auto"
_TODAY = "none,wus,fsdp"
SETUPS = {
    # The config shards in groups of 64 (a row of the pod, section 5.2).
    "transformer_2048": (
        "configs/transformer_1024.py:synthetic",
        "v3:32x32",
        [_AUTO_2048, _EXACT],
        _TABLE1,
        "46.5 -> 25.6 ms (0.55), text of 6.1",
    ),
    "resnet50_2048": (
        "configs/resnet50_1024.py",
        "v3:32x32",
        [_AUTO_2048],
        _TABLE1,
        "~0.94, text of 6.1",
    ),
    "transformer_32": (
        "configs/transformer_16.py:synthetic",
        "v3:4x4",
        [],
        _TABLE1,
        "~0.91 (about 9% faster), text of 6.1",
    ),
    "resnet50_32": ("configs/resnet50_16.py", "v3:4x4", [], _TABLE1, _FIG11),
    "ncf_32": ("configs/ncf_16.py", "v3:4x4", [], _TABLE1, _FIG11),
    # A v5p slice of 1024 chips (groups of 64: a plane of 8x8 chips) and a v6e pod
    # (groups of 16: a row).
    "transformer_v5p_1024": ("configs/transformer_1024.py:synthetic", "v5p:8x8x16", [], _TODAY, ""),
    "transformer_v6e_256": (
        "configs/transformer_1024.py:synthetic",
        "v6e:16x16",
        ["--config.optimizer.shard_group_size=16"],
        _TODAY,
        "",
    ),
    # The same with XLA's async all-gathers (MaxText's flags), and on a v4 pod.
    "transformer_v5p_1024_async": (
        "configs/transformer_1024.py:synthetic",
        "v5p:8x8x16",
        [_ASYNC],
        "none,wus",
        "",
    ),
    "transformer_v6e_256_async": (
        "configs/transformer_1024.py:synthetic",
        "v6e:16x16",
        ["--config.optimizer.shard_group_size=16", _ASYNC],
        "none,wus",
        "",
    ),
    "transformer_v4_512": ("configs/transformer_1024.py:synthetic", "v4:8x8x8", [], "none,wus", ""),
    "transformer_v4_512_async": (
        "configs/transformer_1024.py:synthetic",
        "v4:8x8x8",
        [_ASYNC],
        "none,wus",
        "",
    ),
    # One group of all 2048 cores; Adam vs SGD (the paper's Fig. 8: close peaks).
    "transformer_2048_whole": (
        "configs/transformer_1024.py:synthetic",
        "v3:32x32",
        ["--config.optimizer.shard_group_size=0"],
        "wus",
        "",
    ),
    "transformer_2048_sgd": (
        "configs/transformer_1024.py:synthetic",
        "v3:32x32",
        ["--config.optimizer.name=sgd"],
        "wus",
        "",
    ),
    "transformer_2048_whole_sgd": (
        "configs/transformer_1024.py:synthetic",
        "v3:32x32",
        ["--config.optimizer.name=sgd", "--config.optimizer.shard_group_size=0"],
        "wus",
        "",
    ),
}


def run(name: str, out: str, force: bool) -> dict:
    """The trainer.aot JSON of setup ``name`` (compiled unless already in ``out``)."""
    path = os.path.join(out, f"{name}.json")
    if force or not os.path.exists(path):
        config, topology, extra, modes, _ = SETUPS[name]
        cmd = [
            sys.executable,
            "-m",
            "trainer.aot",
            "--config",
            config,
            "--topology",
            topology,
            "--modes",
            modes,
            "--json",
            path,
            *extra,
        ]
        print("$", " ".join(cmd[1:]), flush=True)
        log = os.path.join(out, f"{name}.log")
        with open(log, "w") as f:
            done = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"{name} failed, see {log}")
    with open(path) as f:
        return json.load(f)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def _step(r: dict, assumption: str = "compiler") -> float:
    return r["est_step_time_s"]["by_assumption"][assumption]["no_overlap"]


def _sent(r: dict) -> float:
    return sum(c["wire_bytes"] * c["times_per_step"] for c in r["collectives"])


def table(results: dict[str, dict]) -> str:
    """The Markdown tables of the README: the ratios, then where the time goes."""
    rows = [
        "| setup | topology | HBM/core none -> wus (GiB) | ratio | bytes sent/core/step none "
        "-> wus (MiB) | ratio | est. step none -> wus, compiler-literal (ms) | ratio | ratio, "
        "optimistic .. pessimistic | auto/none | paper (wus/none step) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        if "none" not in r:
            continue
        none, wus = r["none"], r["wus"]
        others = [_step(wus, a) / _step(none, a) for a in ("optimistic", "pessimistic")]
        auto = f"{_step(r['auto']) / _step(none):.2f}" if "auto" in r else "-"
        rows.append(
            f"| {name} | {SETUPS[name][1]} | {_gib(none['hbm_bytes_per_core'])} -> "
            f"{_gib(wus['hbm_bytes_per_core'])} | "
            f"{wus['hbm_bytes_per_core'] / none['hbm_bytes_per_core']:.2f} | "
            f"{_sent(none) / 2**20:.0f} -> {_sent(wus) / 2**20:.0f} | "
            f"{_sent(wus) / _sent(none):.2f} | "
            f"{_step(none) * 1e3:.1f} -> {_step(wus) * 1e3:.1f} | "
            f"{_step(wus) / _step(none):.2f} | {others[0]:.2f} .. {others[1]:.2f} | {auto} | "
            f"{SETUPS[name][4]} |"
        )
    rows += [
        "",
        "| setup | mode | where a group sits | compute | collectives: optimistic, "
        "bidirectional, compiler, pessimistic (ms) | fsdp, auto |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for mode, m in r.items():
            times = ", ".join(
                f"{e['collectives'] * 1e3:.1f}"
                for e in m["est_step_time_s"]["by_assumption"].values()
            )
            chosen = ""
            if mode in ("fsdp", "auto"):
                group = m["shard_group_size"] or "all"
                chosen = f"{m['mode']}, groups of {group}: step {_step(m) * 1e3:.1f} ms"
            rows.append(
                f"| {name} | {mode} | {m['groups']} | {m['est_compute_s'] * 1e3:.1f} | "
                f"{times} | {chosen} |"
            )
    rows += [
        "",
        "| setup | mode | compile (s) | collectives async | hidden by the schedule (ms) | "
        "step, compiler-literal: no overlap -> overlap (ms) |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        for mode, m in r.items():
            est = m["est_step_time_s"]["by_assumption"]["compiler"]
            per_step = [c for c in m["collectives"] if c["per_step"]]
            hidden = est["no_overlap"] - est["overlap"]
            rows.append(
                f"| {name} | {mode} | {m['compile_s']:.0f} | "
                f"{sum(c['async'] for c in per_step)} of {len(per_step)} | {hidden * 1e3:.2f} | "
                f"{est['no_overlap'] * 1e3:.1f} -> {est['overlap'] * 1e3:.1f} |"
            )
    rows.append("")
    for adam_name, how in (
        ("transformer_2048", "in groups of 64"),
        ("transformer_2048_whole", "2048-way"),
    ):
        if adam_name in results and f"{adam_name}_sgd" in results:
            adam, sgd = results[adam_name]["wus"], results[f"{adam_name}_sgd"]["wus"]
            rows.append(
                f"Under wus {how} on v3:32x32, Transformer-big: Adam "
                f"{_gib(adam['hbm_bytes_per_core'])} GiB vs SGD {_gib(sgd['hbm_bytes_per_core'])}"
                f" GiB per core (x{adam['hbm_bytes_per_core'] / sgd['hbm_bytes_per_core']:.3f})."
            )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="Directory for the JSON and logs.")
    parser.add_argument("--force", action="store_true", help="Compile again even if cached.")
    parser.add_argument("--only", default="", help="Comma-separated setups (default: all).")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    names = [n for n in args.only.split(",") if n] or list(SETUPS)
    results = {name: run(name, args.out, args.force) for name in names}
    print(table(results))


if __name__ == "__main__":
    main()
