"""``python -m trainer.aot --config C --topology v3:32x32 [--modes none,wus,fsdp] [--json FILE]
[--hlo DIR] [--unroll]``.

Compiles the training loop of config ``C`` ahead of time for a TPU topology
this host does not have (libtpu's compiler runs on CPU: ``pip install -e
'.[tpu]'``) and reports, per update-sharding mode, what a pod would see:

* per-core HBM (arguments, outputs, temporaries, generated code, aliased)
  against the chip's, and by how much it does not fit;
* FLOPs and HBM bytes per step and XLA's own ``optimal_seconds``;
* where the update-sharding groups sit on the torus (``group = torus row x, 32
  chips x 2 cores, wraps``);
* every collective of the optimized TPU program: kind, dtype, bytes, replica
  group size, whether it is asynchronous, and the algorithm the back end chose
  (emitter, strategy, ring routes);
* an estimated step time under each named link assumption of
  :mod:`trainer.analysis.costmodel`, from optimistic to pessimistic; the compiler-literal
  one is the headline. ``--hlo DIR`` writes each mode's optimized HLO text
  (``DIR/<mode>.hlo.txt``), for anyone to count the collectives without our parser.

A model with layer stacks has its FLOPs and bytes extrapolated from twins of depths 1
and 2 (:mod:`trainer.analysis.step_cost`); ``--unroll`` compiles the whole model
unrolled for them instead: exact, and one more compile as long as the model is deep.

Nothing is allocated and no dataset is read (:mod:`trainer.analysis.compiled`).
The trainer's ``--config.x=y`` overrides apply; ``--modes auto`` shows the
candidates ``optimizer.update_sharding=auto`` weighs and the one it picks. A
2048-core compile of Transformer-big takes minutes and about 6 GiB.

Example:
python -m trainer.aot --config configs/transformer_16.py:synthetic --topology v3:4x4
"""

from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re

from absl import flags
from ml_collections import config_flags

from trainer import console
from trainer.command import cli, process
from trainer.parallel.plan import MODES
from trainer.workdir import storage

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config: path[:variant].")
_TOPOLOGY = flags.DEFINE_string(
    "topology", None, "TPU topology to compile for, e.g. v3:32x32, v4:4x4x4, v5e:16x16."
)
_NUM_SLICES = flags.DEFINE_integer(
    "num_slices",
    1,
    "Compile for this many slices of the topology, joined by the data-center network "
    "(data parallelism across them: mesh.dcn_axes.data, unless the config sets dcn axes).",
)
_MODES = flags.DEFINE_list(
    "modes", ["none", "wus", "fsdp"], "Update-sharding modes to compile (or auto)."
)
_JSON = flags.DEFINE_string("json", None, "Write the results here as JSON.")
_UNROLL = flags.DEFINE_bool(
    "unroll",
    False,
    "The compute figures of a model with layer stacks from the whole model compiled "
    "unrolled (exact; one more compile, as long as the model is deep) instead of "
    "extrapolated from twins of depths 1 and 2.",
)
_HLO = flags.DEFINE_string("hlo", None, "Write each mode's optimized HLO text into this directory.")
_PROGRAM = flags.DEFINE_string(
    "program",
    None,
    "Instead of compiling --config, read this optimized TPU program (an XLA dump's "
    "*.after_codegen.txt: another framework's, or ours) and apply the same cost model "
    "(trainer/analysis/program.py); its *-memory-usage-report.txt and *-live-range.txt "
    "beside it are read where they exist.",
)
_STEPS_PER_RUN = flags.DEFINE_integer(
    "steps_per_run", 1, "With --program: the training steps one run of it takes (its K)."
)
flags.mark_flags_as_required(["topology"])


def _gib(n: float) -> float:
    return n / 2**30


def _mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def report(results: dict[str, dict]) -> None:
    """Prints one section per mode, then the ratios against ``none``."""
    for name, r in results.items():
        h = r["hbm_breakdown"]
        print(f"\n== {name} ({r['num_devices']} x {r['device_kind']}, K={r['steps_per_loop']}) ==")
        print(f"  {r['groups']}")
        print(f"  compile                    {r['compile_s']:10.1f} s")
        for key in ("argument", "output", "temp", "generated_code", "alias"):
            print(f"  HBM {key:<22} {_mib(h[key]):>16}")
        total, cap = r["hbm_bytes_per_core"], r["hbm_capacity_bytes"]
        verdict = "fits" if r["fits"] else f"does not fit by {_gib(total - cap):.2f} GiB"
        print(f"  HBM per core               {_gib(total):10.3f} GiB of {_gib(cap):.2f}: {verdict}")
        if r["compiler_oom"]:
            print(f"  the TPU compiler: {r['compiler_oom']}")
        # How the FLOPs and bytes below were had: XLA's figures of this program, or of
        # the model unrolled, or extrapolated from twins (step_cost.py), and what the
        # compiles for them (the unrolled model or the twins) took.
        took = f", {r['cost_compile_s']:.1f} s to compile" if r["cost_compile_s"] else ""
        print(f"  figures                    {r['cost_how']}{took}")
        print(f"  flops per step             {r['flops_per_step']:14.4e}")
        print(f"  HBM bytes per step         {r['bytes_accessed_per_step']:14.4e}")
        print(f"  XLA optimal_seconds        {r['xla_optimal_seconds'] * 1e3:10.3f} ms")
        print(f"  whole-program roofline     {r['roofline_seconds'] * 1e3:10.3f} ms")
        # The program's own matmuls and kernels, every layer's (step_cost.py, program.py).
        print(f"  matmul FLOPs, the program  {r['dot_flops_per_step']:14.4e}", end="")
        short = r["matmul_shortfall_flops_per_step"]
        print(f" (XLA's figure {short:.3e} below: added at peak)" if short else "")
        print(f"  flash backward FLOPs       {r['uncosted_flops_per_step']:14.4e} (at peak)")
        print(f"  kernel roofline            {r['program_compute_s'] * 1e3:10.3f} ms")
        print(f"  of it outside fwd and bwd  {r['update_compute_s'] * 1e3:10.3f} ms (the update)")
        counts: dict[tuple, list] = {}
        for c in r["collectives"]:
            if c["per_step"]:
                how = c["emitter"] + (f"/{c['strategy']}" if c["strategy"] else "")
                how += f" x{c['colors']}" if c["colors"] > 1 else ""
                how += ", both ways" if c["both_ways"] else ", one way"
                how += "" if c["reading"] == "read" else " (assumed: no reading)"
                key = (c["kind"], c["dtype"], c["bytes"], c["group_size"], c["async"], how)
                entry = counts.setdefault(key, [0, 0.0])
                entry[0] += c["times_per_step"]  # a layer scan's, once per layer
                entry[1] += c["est_seconds_per_step"]
        print("  collectives per step (n x kind dtype bytes group async algorithm, ms each):")
        for (kind, dtype, size, group, is_async, how), (n, ms) in sorted(
            counts.items(), key=lambda kv: -kv[0][2] * kv[1][0]
        ):
            sync = "async" if is_async else "sync"
            line = f"{n:5.4g} x {kind:<14} {dtype:<4} {_mib(size):>13} {group:5d} {sync:<5} {how}"
            print(f"    {line}  {ms * 1e3 / n if n else 0.0:7.3f}")
        moved = sum(c["bytes"] * c["times_per_step"] for c in r["collectives"])
        wire = sum(c["wire_bytes"] * c["times_per_step"] for c in r["collectives"])
        print(f"  collective buffer bytes    {_mib(moved):>16} per step")
        print(f"  bytes each core sends      {_mib(wire):>16} per step (ring algorithms)")
        if r["num_slices"] > 1:
            kinds = collections.Counter(t["kind"] for t in r["dcn_transfers"] if t["per_step"])
            what = ", ".join(f"{n} x {kind}" for kind, n in sorted(kinds.items())) or "none"
            assumed = " (assumed bandwidth)" if r["dcn_bandwidth_assumed"] else ""
            print(
                f"  DCN: {what} per step; each host ({r['devices_per_host']} devices) sends "
                f"{_mib(r['dcn_bytes_per_host_per_step'])}{assumed}"
            )
            unprinted = sorted({a for t in r["dcn_transfers"] for a in t["assumed"]})
            if unprinted:  # fields a send did not print: what stands in for them
                print(f"  DCN, assumed: {'; '.join(unprinted)}")
        source = "XLA roofline" if r["compute_source"] == "xla" else "published roofline"
        print(f"  compute, {source:<19} {r['est_compute_s'] * 1e3:8.2f} ms")
        for assumption, e in r["est_step_time_s"]["by_assumption"].items():
            mark = "  <- compiler-literal" if assumption == "compiler" else ""
            dcn = f", DCN {e['dcn'] * 1e3:.2f} ms" if r["num_slices"] > 1 else ""
            hidden = e["no_overlap"] - e["overlap"]
            hidden = f", {hidden * 1e3:.2f} ms of it hidden by the schedule" if hidden else ""
            print(
                f"  step, {assumption:<14}      {e['no_overlap'] * 1e3:10.2f} ms (collectives "
                f"{e['collectives'] * 1e3:.2f} ms{dcn}{hidden}){mark}"
            )
    if "none" in results:
        base = results["none"]
        for name, r in results.items():
            if name == "none":
                continue
            hbm = r["hbm_bytes_per_core"] / base["hbm_bytes_per_core"]
            moved = _sent(r) / max(_sent(base), 1)
            before = base["est_step_time_s"]["by_assumption"]
            ratios = ", ".join(
                f"{a} x{e['no_overlap'] / before[a]['no_overlap']:.2f}"
                for a, e in r["est_step_time_s"]["by_assumption"].items()
            )
            dcn = ""
            if r["num_slices"] > 1 and base["dcn_bytes_per_host_per_step"]:
                share = r["dcn_bytes_per_host_per_step"] / base["dcn_bytes_per_host_per_step"]
                dcn = f", DCN bytes per host x{share:.3f}"
            print(
                f"{name} vs none: HBM/core x{hbm:.3f}, bytes sent x{moved:.2f}{dcn}, "
                f"estimated step time {ratios}"
            )


def _sent(r: dict) -> float:
    """Bytes each core sends a step (ring algorithms)."""
    return sum(c["wire_bytes"] * c["times_per_step"] for c in r["collectives"])


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    # The host only compiles: keep JAX's default backend on CPU.
    process.setup(cpu_devices=1, compiles_for_tpu=True)
    import jax  # noqa: PLC0415  (after setup)

    # No persistent compilation cache (one set in the environment included): JAX
    # writes what it compiles for a topology but cannot read it back without a
    # client of that topology, and warns on every hit.
    jax.config.update("jax_enable_compilation_cache", False)
    from trainer.analysis import compiled as compiled_lib  # noqa: PLC0415  (imports JAX)

    if _PROGRAM.value:
        with cli.clear_errors():
            _read_program(_PROGRAM.value, _TOPOLOGY.value, _STEPS_PER_RUN.value)
        return
    config = _CONFIG.value
    if config is None:
        cli.fail("name a run to compile (--config) or a compiled program to read (--program)")
    known = (*MODES, "auto")
    # Everything the user can get wrong is checked before minutes of compiling.
    if not _MODES.value:
        cli.fail("--modes is empty: name the modes to compile, e.g. --modes none,wus (or auto)")
    if unknown := [m for m in _MODES.value if m not in known]:
        cli.fail(f"--modes: {', '.join(map(repr, unknown))} not one of {', '.join(known)}")
    slices = _NUM_SLICES.value
    if slices < 1:
        cli.fail(f"--num_slices must be >= 1, got {slices}")
    dcn = config.mesh.dcn_axes
    if slices > 1 and math.prod(dcn.values()) == 1:
        dcn.data = slices  # data parallelism across the slices
    elif math.prod(dcn.values()) != slices:
        cli.fail(
            f"--num_slices={slices} but mesh.dcn_axes {dcn.to_dict()} multiply to "
            f"{math.prod(dcn.values())} slices"
        )
    with cli.clear_errors():
        json_out = storage.output_file(_JSON.value, "--json") if _JSON.value else None
        hlo_dir = storage.make_directory(_HLO.value, "--hlo") if _HLO.value else None
        devices = compiled_lib.topology_devices(_TOPOLOGY.value, slices)
        # libtpu logs its refusal of the 1 TiB buffer that sizes its HBM budget, with a
        # memory report, to stderr: not the run's; asked once here, then cached.
        with _stderr_silenced():
            compiled_lib.compiler_hbm_budget(devices[0])
        results = compile_modes(
            config, devices, _MODES.value, json_out, hlo_dir, unroll=_UNROLL.value
        )
    report(results)
    if json_out:
        json_out.write_text(json.dumps(results, indent=2))


@contextlib.contextmanager
def _stderr_silenced():
    """File descriptor 2 to /dev/null for the block (what native libraries write too)."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _read_program(location: str, topology: str, steps_per_run: int) -> None:
    """The cost model on a program known by its text (``--program``)."""
    from trainer.analysis import compiled as compiled_lib  # noqa: PLC0415  (imports JAX)
    from trainer.analysis import program  # noqa: PLC0415
    from trainer.parallel import hardware  # noqa: PLC0415
    from trainer.parallel import mesh as mesh_lib  # noqa: PLC0415

    text = storage.path(location).read_text()
    beside = {}
    for suffix in ("memory-usage-report", "live-range"):
        sibling = re.sub(r"after_\w+\.txt$", f"after_optimizations-{suffix}.txt", location)
        if sibling != location and storage.path(sibling).exists():
            beside[suffix] = storage.path(sibling).read_text()
    devices = compiled_lib.topology_devices(topology)
    # Partition ids in our mesh's (physical) order: what our programs use (program.py).
    mesh = mesh_lib.make_mesh({"data": -1}, {"data": 1}, devices=devices)
    r = program.analyze_program(
        text,
        list(mesh.devices.flat),
        hardware.lookup(devices[0].device_kind),
        steps_per_run=steps_per_run,
        memory_usage_report=beside.get("memory-usage-report"),
        live_range=beside.get("live-range"),
    )
    print(f"\n== {location} ({r['num_devices']} x {r['device_kind']}, K={steps_per_run}) ==")
    print(f"  compute (roofline of its kernels)  {r['compute_s'] * 1e3:12.2f} ms")
    print(f"  matmul + attention FLOPs a step    {r['flops_per_step']:12.4e}")
    print(f"  kernel HBM bytes a step            {r['bytes_per_step']:12.4e}")
    for kind, row in sorted(r["collectives"].items()):
        print(
            f"  {kind:<22} {row['count']:8.1f} a step ({row['async']:.0f} async), "
            f"{row['bytes'] / 2**30:8.2f} GiB"
        )
    for assumption, e in r["est_step_time_s"].items():
        print(
            f"  step, {assumption:<14} {e['no_overlap'] * 1e3:10.2f} ms (collectives "
            f"{e['collectives'] * 1e3:.2f} ms, {e['hidden'] * 1e3:.2f} ms hidden by the schedule)"
        )
    if r["hbm_heap_bytes"]:
        print(f"  XLA's heap                        {_gib(r['hbm_heap_bytes']):9.3f} GiB")
    if r["live_at_peak"]:
        print(f"  live at its peak                  {_gib(r['live_at_peak_bytes']):9.3f} GiB:")
        for what, size in r["live_at_peak"][:8]:
            print(f"    {_mib(size):>14}  {what[-100:]}")
    if _JSON.value:
        storage.output_file(_JSON.value, "--json").write_text(json.dumps(r, indent=2))


def compile_modes(
    config, devices: list, modes: list[str], json_out=None, hlo_dir=None, *, unroll: bool = False
) -> dict:
    """Compiles and analyses ``config`` on ``devices`` in each of ``modes`` (or
    ``auto``), one after another; returns ``{mode: its figures}``.

    Each mode's files are written as soon as they exist, so that a run stopped after
    hours keeps what it had: ``hlo_dir/<mode>.hlo.txt`` once the program is compiled
    (before its twins), the JSON of every mode done so far once its figures are.
    ``json_out`` and ``hlo_dir`` are paths (:mod:`trainer.workdir.storage`) or None;
    ``unroll`` as :func:`trainer.analysis.compiled.analyze` takes it.
    """
    from trainer.analysis import compiled as compiled_lib  # noqa: PLC0415  (imports JAX)

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    where = f"{len(devices)} {devices[0].device_kind} devices"
    where += f" ({slices} slices)" if slices > 1 else ""
    results = {}
    for mode in modes:
        if mode == "auto":
            console.say("update_sharding=auto candidates:")
            _, _, results["auto"] = compiled_lib.choose_update_sharding(
                config, devices, console.say, unroll=unroll
            )
        else:
            write_hlo = (hlo_dir / f"{mode}.hlo.txt").write_text if hlo_dir else None
            with console.phase(f"{mode}: compiling for {where}", done="compiled"):
                results[mode] = compiled_lib.analyze(
                    config, devices, mode, unroll=unroll, on_program=write_hlo
                )
            r = results[mode]
            estimate = r["est_step_time_s"]["by_assumption"]["compiler"]["no_overlap"]
            console.say(
                f"{mode}: HBM/core {_gib(r['hbm_bytes_per_core']):.3f} GiB "
                f"({'fits' if r['fits'] else 'does not fit'}), est. step {estimate * 1e3:.2f} ms "
                f"(compiler-literal)"
            )
        if json_out:
            json_out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    process.run(main)
