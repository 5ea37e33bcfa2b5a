"""``python -m trainer.bench --config C [--modes none,fsdp,wus] [--json FILE]``.

Compiles and times the training loop of config ``C`` once per update-sharding
mode, on the same devices, and prints per mode: step time (median of several
loops), per-device bytes of weights + optimizer state (from the addressable
shards), per-device argument and temp bytes (``compiled.memory_analysis()``) and
collective bytes per step by kind and dtype (from the HLO after SPMD
partitioning). Takes the trainer's ``--config.x=y`` overrides and ``--cpu_devices``.

``--plan`` prints only the per-parameter sharding plan of every mode (a column per
mode: layout, padding, gather dtype; the parameter names ``init_from_skip`` takes),
in seconds: nothing is compiled or timed.

``--steps_per_loop 1,8`` times several loop lengths in the same run;
``--measure_peak`` measures this machine's matmul peak for MFU; ``--plot FILE.png``
draws step time, per-device state and temp bytes, and collective bytes by kind
of every mode side by side. Each mode says one line as soon as it is timed; the
details, the sharding plan (a column per mode) and the ratios follow.

Example:
python -m trainer.bench --config configs/transformer_1024.py:tiny --cpu_devices 8 --modes none,wus
"""

from __future__ import annotations

import json

from absl import flags
from ml_collections import config_flags

from trainer import console
from trainer.command import cli, process
from trainer.parallel.hardware import measure_matmul_peak
from trainer.parallel.plan import MODES
from trainer.workdir import storage

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config: path[:variant].")
_MODES = flags.DEFINE_list("modes", ["none", "fsdp", "wus"], "Update-sharding modes to time.")
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON.")
_LOOPS = flags.DEFINE_integer("loops", 5, "Timed loops per mode (after one warm-up loop).")
_STEPS_PER_LOOP = flags.DEFINE_list(
    "steps_per_loop", [], "Loop lengths K to time (default: the config's)."
)
_MEASURE_PEAK = flags.DEFINE_bool(
    "measure_peak", False, "Measure the devices' matmul peak and report MFU against it."
)
_PLAN = flags.DEFINE_bool(
    "plan", False, "Only print each mode's per-parameter sharding plan (no compile, no timing)."
)
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", None, "Also time async vs sync checkpoint saves of each mode's state here."
)
_PLOT = flags.DEFINE_string(
    "plot", None, "Also draw the modes side by side into this PNG (needs '.[plot]')."
)
_CPU_DEVICES = flags.DEFINE_integer("cpu_devices", 0, "Expose this many CPU devices.")
flags.mark_flags_as_required(["config"])


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def mode_line(mode: str, r: dict) -> str:
    """One line of a mode's figures, said as soon as the mode is timed."""
    parts = [f"step {r['step_time_s'] * 1e3:.2f} ms (K={r['steps_per_loop']})"]
    parts += [
        f"K={k}: {f['examples_per_sec']:,.1f} examples/s"
        + (f", MFU {f['mfu']:.2%}" if f["mfu"] == f["mfu"] else "")
        for k, f in r["by_steps_per_loop"].items()
    ]
    parts += [
        f"state/device {_mib(r['state_bytes_per_device'])}",
        f"temp/device {_mib(r['temp_bytes'])}",
        f"collectives {_mib(sum(r['collective_bytes'].values()))}/step/device",
    ]
    if "checkpoint" in r:
        c = r["checkpoint"]
        parts.append(
            f"save blocks async {c['async_blocking_s']:.3f}s, sync {c['sync_blocking_s']:.3f}s"
        )
    return f"{mode}: " + "; ".join(parts)


def report(results: dict, peak: float, measured: bool) -> None:
    """Prints the details of every mode, the sharding plan once (a column per
    mode) and the ratios against ``none``."""
    for mode, r in results.items():
        print(f"\n== {mode} ==")
        print(f"  argument bytes/device      {_mib(r['argument_bytes']):>14}")
        for kind, n in sorted(r["collective_bytes"].items()):
            print(f"  collective {kind:<22} {_mib(n):>14} per step per device")
        if "checkpoint" in r:
            c = r["checkpoint"]
            on_disk, state = _mib(c["disk_bytes"]), _mib(c["state_bytes"])
            print(f"  checkpoint on disk {on_disk} for {state} of state")
        print(f"  {r['groups']}")
    if peak:
        source = (
            "measured at this run's start" if measured else "the device kind's, or the config's"
        )
        print(f"\npeak FLOP/s for MFU: {peak:.3e} ({source})")
    if "none" in results:
        base = results["none"]
        for mode, r in results.items():
            if mode == "none":
                continue
            base_coll = sum(base["collective_bytes"].values()) or 1.0
            state = r["state_bytes_per_device"] / base["state_bytes_per_device"]
            print(
                f"{mode} vs none: step time x{r['step_time_s'] / base['step_time_s']:.2f}, "
                f"state/device x{state:.3f}, "
                f"collective bytes x{sum(r['collective_bytes'].values()) / base_coll:.2f}"
            )


def plan_table(results: dict) -> str:
    """The per-parameter sharding plan: one row per parameter, one layout column per
    mode, and with several slices one column per mode of what crosses them (``dcn``)."""
    modes = list(results)
    rows: dict[tuple[str, str], dict[str, str]] = {}
    for mode in modes:
        for name, shape, layout, crossing in results[mode]["plan"]:
            rows.setdefault((name, shape), {})[mode] = layout
            if crossing:
                rows[(name, shape)][f"{mode} dcn"] = crossing
    if any(f"{m} dcn" in r for r in rows.values() for m in modes):
        modes = [column for m in modes for column in (m, f"{m} dcn")]
    widths = [max([len("parameter")] + [len(name) for name, _ in rows])]
    widths.append(max([len("shape")] + [len(shape) for _, shape in rows]))
    widths += [max([len(m)] + [len(r.get(m, "-")) for r in rows.values()]) for m in modes]

    def line(cells) -> str:
        return "  " + "  ".join(f"{c:<{w}}" for c, w in zip(cells, widths, strict=True)).rstrip()

    out = ["\nsharding plan:", line(["parameter", "shape", *modes])]
    for (name, shape), layouts in rows.items():
        out.append(line([name, shape, *(layouts.get(m, "-") for m in modes)]))
    return "\n".join(out)


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    config = _CONFIG.value
    try:
        loop_lengths = [int(k) for k in _STEPS_PER_LOOP.value] or [config.steps_per_loop]
    except ValueError:
        cli.fail(f"--steps_per_loop: expected loop lengths like 1,8, got {_STEPS_PER_LOOP.value}")
    if min(loop_lengths) < 1 or _LOOPS.value < 1:
        cli.fail(f"--steps_per_loop {loop_lengths} and --loops {_LOOPS.value} must be >= 1")
    if not _MODES.value:
        cli.fail("--modes is empty: name the modes to time, e.g. --modes none,wus")
    if unknown := [m for m in _MODES.value if m not in MODES]:
        cli.fail(f"--modes: {', '.join(map(repr, unknown))} not one of {', '.join(MODES)}")
    process.setup(cpu_devices=_CPU_DEVICES.value)
    with cli.clear_errors():  # the outputs, before minutes of work
        json_out = storage.output_file(_JSON.value, "--json") if _JSON.value else None
        if _PLOT.value:
            storage.output_file(_PLOT.value, "--plot")
    import jax  # noqa: PLC0415  (after setup)

    # Every mode's program is compiled with a dump of its HLO (the collectives it
    # counts): a persistent-cache hit would dump nothing (hlo.compile_with_dump).
    jax.config.update("jax_enable_compilation_cache", False)

    from trainer.analysis import benchmark  # noqa: PLC0415  (imports JAX, Flax, Orbax)
    from trainer.parallel import hardware  # noqa: PLC0415  (after setup)

    if _PLAN.value:
        with cli.clear_errors():
            plans = {mode: benchmark.plan_mode(config, mode) for mode in _MODES.value}
        for mode, plan in plans.items():
            print(f"{mode}: {plan['groups']}")
        print(plan_table(plans))
        return
    with cli.clear_errors():
        if _MEASURE_PEAK.value:
            with console.phase("measuring this machine's matmul peak"):
                peak = measure_matmul_peak(config.model.get("dtype", "float32"))
        else:
            peak = jax.device_count() * hardware.peak_flops_per_device(
                jax.devices(), config.peak_flops_per_device
            )
        results = {}
        for mode in _MODES.value:
            with console.phase(f"{mode}: building, compiling and timing", done="timed"):
                results[mode] = benchmark.bench_mode(
                    config, mode, loop_lengths, _LOOPS.value, peak, _CHECKPOINT_DIR.value
                )
            console.say(mode_line(mode, results[mode]))
    report(results, peak, _MEASURE_PEAK.value)
    if json_out:
        json_out.write_text(json.dumps(results, indent=2))
    if _PLOT.value:
        from trainer.analysis import figures  # noqa: PLC0415  (matplotlib, an extra)

        figures.plot_bench(results, _PLOT.value)
        print(f"wrote {_PLOT.value}")


if __name__ == "__main__":
    process.run(main)
