"""The run compiled ahead of time for TPU devices: HBM, collectives, estimated
step time; and ``optimizer.update_sharding=auto``, which picks the mode from them.

:func:`analyze` builds the run exactly as the trainer does (model, plan,
optimizer, K-step loop, batch shapes from the config) but with abstract state
and batches on the given devices, which may be those of a TPU topology this host
only compiles for (libtpu's compiler runs on CPU). No dataset is opened and
nothing is allocated. :mod:`trainer.aot` is its command line.

Back-end facts that shape the reading (measured with libtpu 0.0.42.1, see the
README): on TPU v2/v3/v4 a reduce-scatter over a whole slice is compiled to a
full all-reduce plus a dynamic-slice, and an all-gather over a whole slice
larger than 4x4 whose result is at most ~16 MiB to an all-reduce of a
zero-filled buffer; over a sub-group (``optimizer.shard_group_size``) both stay
true reduce-scatters and all-gathers unless tiny. The collectives listed and
costed are those the TPU runs.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable

import jax

from trainer.analysis import costmodel, hlo, program, step_cost
from trainer.errors import ConfigError
from trainer.parallel import hardware, torus
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import plan as plan_lib
from trainer.training import experiment


def topology_options(name: str) -> dict:
    """What libtpu needs to describe topology ``name`` as the hardware is: which
    dimensions wrap around, and one device per chip on v4 as JAX runs it.

    libtpu's compile-only topologies are meshes unless told otherwise (no
    wrap-around), and expose v4's two cores as two devices; both change what the
    compiler emits. ``v5p:4x4x8_twisted`` (a twisted torus) wraps everywhere.
    """
    generation, _, dims = name.partition(":")
    spec = torus.GENERATIONS.get(generation)
    if spec is None:
        return {}
    twisted = dims.endswith("_twisted")
    try:
        shape = [
            int(d) for d in dims.removesuffix("_twisted").removesuffix("_untwisted").split("x")
        ]
    except ValueError:
        return {}  # libtpu says what is wrong with the name
    wraps = [True] * len(shape) if twisted else list(spec.wraps(shape))
    options = {"wrap": [int(w) for w in wraps] + [0] * (3 - len(wraps))}
    if generation == "v4":
        options["chip_config_name"] = "megacore"
    return options


def topology_devices(name: str, num_slices: int = 1) -> list:
    """The devices of TPU topology ``name`` (e.g. ``v3:4x4``), compile-only, with
    the wrap-around links the real slice has (:func:`topology_options`); with
    ``num_slices`` > 1, of that many such slices joined by the data-center network
    (devices with a ``slice_index``).

    Several processes of a host compile at once only with ALLOW_MULTIPLE_LIBTPU_LOAD=1
    in the environment (:func:`trainer.command.process.setup` sets it for commands that
    compile for topologies).

    Raises:
      ConfigError: libtpu is missing, or the name is not a topology it knows.
    """
    try:
        from jax.experimental import topologies  # noqa: PLC0415

        slices = {"num_slices": num_slices} if num_slices > 1 else {}
        description = topologies.get_topology_desc(
            platform="tpu", topology_name=name, **topology_options(name), **slices
        )
        return list(description.devices)
    except Exception as e:  # libtpu missing or a bad name: both reach here as errors
        text = " ".join(str(e).split())
        lower = text.lower()
        # JAX 0.10 says "JAX TPU support not installed; cannot generate TPU topology".
        missing = ("libtpu", "unknown backend", "plugin", "tpu support not installed")
        if any(word in lower for word in missing):
            raise ConfigError(
                f"compiling for TPU topology '{name}' needs libtpu: pip install -e '.[tpu]' "
                f"({text[:200]})"
            ) from e
        raise ConfigError(f"--topology {name}: {text[:300]}") from e


@functools.cache
def _budget(device) -> float | None:
    huge = jax.jit(
        lambda: jax.numpy.zeros((2**20, 2**20), jax.numpy.int8),  # 1 TiB: more than any chip
        out_shardings=jax.sharding.SingleDeviceSharding(device),
    )
    try:
        huge.lower().compile()
    except jax.errors.JaxRuntimeError as e:
        found = re.search(r"exceeds available HBM \(([\d.]+)G\)", str(e))
        return float(found.group(1)) * 2**30 if found else None
    return None


def compiler_hbm_budget(device) -> float | None:
    """The HBM the TPU compiler lets a program of ``device`` use, as libtpu sizes it:
    read from its out-of-memory message for a 1 TiB buffer (a compile of a moment),
    to the 0.01 GiB it prints ("exceeds available HBM (31.24G)"). libtpu 0.0.52: v3
    15.48 GiB a core, v4 30.75, v5e 15.75, v5p 95.73, v6e 31.24. None where it says
    nothing of the kind (not a TPU, another message). Cached per device. libtpu logs
    the refusal, with a memory report, to the process's stderr; a command that wants
    it off its console asks here first with stderr silenced (``trainer.aot`` does)."""
    if getattr(device, "platform", "") != "tpu":
        return None
    return _budget(device)


def analyze(
    config,
    devices: list,
    mode: str | None = None,
    *,
    twins: bool = True,
    unroll: bool = False,
    on_program: Callable[[str], None] | None = None,
) -> dict:
    """Compiles the K-step training loop of ``config`` on ``devices`` and reports it.

    Args:
      config: the run config (not modified).
      devices: devices of a TPU topology (or real TPU devices), in any order.
      mode: update-sharding mode to use instead of the config's.
      twins: as :func:`trainer.analysis.step_cost.per_step` takes it (False: quicker,
        where only the collectives and HBM matter).
      unroll: the compute figures of the whole model compiled unrolled (exact; one
        more compile, as long as the model is deep) instead of extrapolated from twins.
      on_program: called with the optimized HLO text as soon as the program is
        compiled, before the twins (minutes, for a large model) are.

    Returns:
      The figures of this run (see the module docstring and the README schema).
    """
    config = config.copy_and_resolve_references()
    if mode is not None:
        config.optimizer.update_sharding = mode
    accelerator = hardware.lookup(devices[0].device_kind)
    if accelerator is None or not accelerator.ici_links_per_chip or torus.Torus.of(devices) is None:
        raise ConfigError(f"no TPU figures for device kind '{devices[0].device_kind}'")
    exp = experiment.build(config, devices=devices, with_data=False)
    k = config.steps_per_loop
    start = time.perf_counter()
    compiled, oom = _compile(experiment.lower_loop(exp, k), config)
    compile_s = time.perf_counter() - start
    hbm, total = _hbm(compiled)
    text = compiled.as_text()
    if on_program is not None:
        on_program(text)
    cost = step_cost.per_step(compiled, config, devices, text=text, twins=twins, unroll=unroll)
    # A multi-slice program is that of one slice: its collectives' partition ids are
    # one slice's devices (in the mesh's order); what crosses slices is a DCN transfer.
    num_slices = math.prod(config.mesh.dcn_axes.values())
    slice_devices = mesh_lib.slices(list(exp.mesh.devices.flat), num_slices)[0]
    found = hlo.collectives(text, len(slice_devices))
    dcn = hlo.dcn_transfers(text, num_slices)
    has_loop = " while(" in text  # the K-step loop (a program of one step has none)
    topo = costmodel.Topology.from_devices(accelerator, slice_devices)
    cores = topo.cores_per_chip
    per_host = sum(d.process_index == slice_devices[0].process_index for d in slice_devices)
    flops, bytes_accessed, xla_seconds = cost.flops, cost.bytes_accessed, cost.optimal_seconds
    roofline = costmodel.roofline_seconds(flops, bytes_accessed, accelerator, cores)
    # The same compute read from the program's text alone, as another framework's
    # program is read (program.py), and the part of it outside the forward and
    # backward passes: the optimizer's update.
    text_compute, update_compute = _text_compute(text, accelerator, cores, k if has_loop else 1)
    compute_source, compute_s = _compute(cost, roofline, text_compute, accelerator, cores)
    # What each async collective overlaps, timed by its kernels' roofline (program.py).
    windows = program.window_seconds(text, found, accelerator, cores)
    estimates = _estimates(compute_s, found, topo, k, has_loop, windows, dcn)
    estimate, _ = estimates[costmodel.COMPILER]
    # What libtpu lets a program use (v6e: 31.24 GiB, where the published "32 GB" are
    # 29.8 GiB), else the published capacity.
    capacity = compiler_hbm_budget(devices[0]) or accelerator.hbm_bytes(cores)
    return {
        "mode": exp.plan.mode,
        "shard_group_size": config.optimizer.shard_group_size,
        "min_shard_bytes": config.optimizer.min_shard_bytes,
        "device_kind": devices[0].device_kind,
        "num_devices": exp.mesh.devices.size,
        "num_slices": num_slices,
        "groups": mesh_lib.describe_groups(exp.mesh, num_slices),
        "steps_per_loop": k,
        "hbm_bytes_per_core": total,
        "hbm_breakdown": hbm,
        "hbm_capacity_bytes": capacity,
        "hbm_published_bytes": accelerator.hbm_bytes(cores),
        "fits": total <= capacity and not oom,
        "compiler_oom": oom,
        "flops_per_step": flops,
        "bytes_accessed_per_step": bytes_accessed,
        "xla_optimal_seconds": xla_seconds,
        "roofline_seconds": roofline,
        "compute_source": compute_source,
        # Flash attention's backward kernels, which XLA counts as free (step_cost.py).
        "uncosted_flops_per_step": cost.uncosted_flops,
        # The program's own matmul FLOPs a step, every layer's, and how far XLA's
        # figure (of the twins) falls below them (step_cost.py).
        "dot_flops_per_step": cost.dot_flops,
        "matmul_shortfall_flops_per_step": cost.matmul_shortfall_flops,
        "collectives": [
            _collective_row(c, i, k, has_loop, estimates, windows) for i, c in enumerate(found)
        ],
        # What crosses slices over the data-center network, per step.
        "dcn_transfers": [_dcn_row(t, k, has_loop) for t in dcn],
        "dcn_bytes_per_host_per_step": per_host
        * sum(t.wire_bytes * t.per_step(k, has_loop) for t in dcn),
        "devices_per_host": per_host,
        "dcn_bandwidth_assumed": accelerator.dcn_assumed,
        # The compiler-literal estimate, and every assumption's (trainer/analysis/costmodel.py).
        "est_step_time_s": {
            "overlap": estimate.overlap_s,
            "no_overlap": estimate.no_overlap_s,
            "by_assumption": {name: _times(e) for name, (e, _) in estimates.items()},
        },
        "est_compute_s": estimate.compute_s,
        # Compute as program.py reads any program's text (its kernels' roofline), and
        # that of the kernels outside the forward and backward passes (the update).
        "program_compute_s": text_compute,
        "update_compute_s": update_compute,
        "compile_s": compile_s,
        # The compiles of the unrolled twins that gave the compute figures (0: none).
        "cost_compile_s": cost.compile_s,
        "cost_how": cost.how,
    }


def _compute(cost, roofline, kernels, accelerator, cores) -> tuple[str, float]:
    """Where a step's compute comes from (``"xla"`` or ``"roofline"``), and its seconds
    (``roofline``: the whole program's; ``kernels``: the sum of its kernels')."""
    # Kernels XLA counts as free (flash attention's backward), and the matmuls the
    # twins lost (step_cost.py), at the chip's peak.
    uncosted_s = (cost.uncosted_flops + cost.matmul_shortfall_flops) / accelerator.peak_flops(cores)
    if cost.optimal_seconds > 0:
        return "xla", cost.optimal_seconds + uncosted_s
    # XLA's optimal_seconds of a multi-slice program comes out negative (-30 s and
    # change, libtpu 0.0.42.1: its DCN transfers' entry). There the compute is the
    # roofline of the program's kernels, each its own (at least the whole program's,
    # which overlaps every kernel's memory traffic with every other's matmuls: on
    # v5p-32b-2slices 8.77 s, where the same chip's program on one slice took 11.37 s
    # by XLA's figure and 9.43 s by its kernels').
    return "roofline", max(roofline + uncosted_s, kernels)


def _estimates(compute_s, found, topo, k, has_loop, windows, dcn) -> dict:
    """The step estimate under each of the cost model's assumptions, by name."""
    return {
        name: costmodel.estimate_step(
            compute_s=compute_s,
            collectives=found,
            topo=topo,
            steps_per_loop=k,
            has_loop=has_loop,
            assumption=name,
            windows_s=windows,
            dcn=dcn,
        )
        for name in costmodel.ASSUMPTIONS
    }


def _text_compute(text, accelerator, cores, per_run) -> tuple[float, float]:
    """The compute of a step read from the program's text (its kernels' roofline),
    and that of its kernels outside the forward and backward passes (the update)."""
    whole = program.roofline(text, accelerator, cores).seconds
    update = program.roofline(text, accelerator, cores, program.outside_the_passes).seconds
    return whole / per_run, update / per_run


def _dcn_row(transfer, k, has_loop) -> dict:
    """One transfer across slices, as the report lists it."""
    return {
        "kind": transfer.kind,
        "bytes": transfer.bytes,
        "wire_bytes": transfer.wire_bytes,
        "slices": transfer.slices,
        "per_step": transfer.in_loop or not has_loop,
        "times_per_step": transfer.per_step(k, has_loop),
        "assumed": list(transfer.assumed),
    }


def _compile(lowered, config):
    """``(compiled, "")``, or for a program over the HBM limit ``(compiled with the
    check off, the compiler's message)``: the TPU compiler refuses such a program,
    and compiling it again with the check off tells how much it needs. Where libtpu
    cannot build it with the check off either (0.0.52 answers "Invalid TPU program"
    for some v3 programs), the refusal is the answer: a ConfigError with its message."""
    try:
        return experiment.compile_lowered(lowered, config), ""
    except jax.errors.JaxRuntimeError as e:
        if "Ran out of memory" not in str(e):
            raise
        oom = " ".join(str(e).split())
    try:
        return experiment.compile_lowered(lowered, config, xla_tpu_no_crash_on_oom=True), oom
    except jax.errors.JaxRuntimeError as e:
        again = " ".join(str(e).split())
        raise ConfigError(
            f"does not fit: {oom} (compiled again with xla_tpu_no_crash_on_oom to measure "
            f"it, libtpu refused it: {again})"
        ) from None


def _hbm(compiled) -> tuple[dict[str, int], int]:
    """XLA's memory analysis of ``compiled``, and the bytes a core holds in all."""
    memory = compiled.memory_analysis()
    hbm = {
        "argument": int(memory.argument_size_in_bytes),
        "output": int(memory.output_size_in_bytes),
        "temp": int(memory.temp_size_in_bytes),
        "generated_code": int(memory.generated_code_size_in_bytes),
        "alias": int(memory.alias_size_in_bytes),
    }
    # Donated inputs alias their outputs: count those bytes once.
    total = hbm["argument"] + hbm["output"] - hbm["alias"] + hbm["temp"] + hbm["generated_code"]
    return hbm, total


def _times(e: costmodel.StepEstimate) -> dict[str, float]:
    collectives = e.async_collective_s + e.sync_collective_s
    return {
        "overlap": e.overlap_s,
        "no_overlap": e.no_overlap_s,
        "collectives": collectives,
        "dcn": e.dcn_s,
    }


def _collective_row(
    c: hlo.Collective, i: int, k: int, has_loop: bool, estimates: dict, windows: dict
) -> dict:
    """The report of collective ``c`` (the ``i``-th found), with its seconds under
    each assumption of ``estimates``."""
    reading = costmodel.reading(c)
    return {
        "kind": c.kind,
        "dtype": c.dtype,
        "bytes": c.buffer_bytes,
        "wire_bytes": c.wire_bytes,
        "group_size": c.group_size,
        "async": c.is_async,
        "emitter": c.emitter,
        "strategy": c.algorithm.strategy,
        "colors": c.algorithm.colors,
        "phases": c.algorithm.phases,
        "algorithm_dims": c.algorithm.dims,
        # How the cost model runs it (costmodel.reading): read, or assumed.
        "both_ways": reading.both_ways,
        "bytes_factor": reading.bytes_factor,
        "reading": reading.note,
        "per_step": c.in_loop or not has_loop,
        # Runs a step: a collective inside a layer scan runs once per layer.
        "times_per_step": c.per_step(k, has_loop),
        "est_seconds_per_step": estimates[costmodel.COMPILER][1][i],
        # What the schedule runs while an asynchronous one is in flight.
        "overlap_window_s": windows.get(c.name, 0.0) if c.is_async else 0.0,
        "est_seconds_by_assumption": {name: secs[i] for name, (_, secs) in estimates.items()},
    }


def candidate_groups(config, devices: list) -> list[int]:
    """The ``shard_group_size`` values ``update_sharding=auto`` tries on ``devices``:
    ``optimizer.auto.shard_group_sizes``, or else the groupings that sit on rings
    of the torus (:func:`trainer.parallel.torus.ring_group_sizes`: a row, two rows, a plane,
    ..., the whole slice) and divide the data axis; 0 stands for the whole axis."""
    n = config.mesh.num_devices or len(devices)
    mesh = mesh_lib.make_mesh(
        config.mesh.axes.to_dict(), config.mesh.dcn_axes.to_dict(), devices=devices[:n]
    )
    data = mesh.shape[mesh_lib.DATA_AXIS]  # a slice's share: groups never span slices
    one_slice = mesh_lib.slices(devices[:n], math.prod(config.mesh.dcn_axes.values()))[0]
    model = len(one_slice) // data  # devices a model axis takes from each group
    wanted = list(config.optimizer.auto.shard_group_sizes)
    if not wanted:
        wanted = [s // model for s in torus.ring_group_sizes(one_slice) if s % model == 0]
    groups = [g for g in wanted if g > 1 and data % g == 0]
    return sorted({0 if g == data else g for g in groups}, key=lambda g: g or data)


def choose_update_sharding(config, devices: list, log=print, *, unroll: bool = False):
    """Resolves ``optimizer.update_sharding=auto`` for ``devices``.

    On TPU devices (real, or a topology's) it compiles ``none`` and, for every
    grouping of :func:`candidate_groups` and ``optimizer.auto.min_shard_bytes``
    (empty: the config's), ``wus``, and ``fsdp`` where ``wus`` of that grouping
    does not fit HBM (ZeRO-3 gathers twice: it only wins on memory). Of the
    candidates that fit, the fastest compiler-literal estimate wins (the
    optimistic one breaks ties). Elsewhere there is no trustworthy model and
    ``auto`` means ``wus``. Prints the candidates as a table through ``log``.
    ``unroll``: each candidate's compute figures as :func:`analyze` takes it.

    Returns:
      ``(config with the choice, rows, chosen row)``; each row a candidate's
      figures as :func:`analyze` gives them (empty and None off TPU).
    """
    config = config.copy_and_resolve_references()
    opt = config.optimizer
    if devices[0].platform != "tpu":
        log(
            f"update_sharding=auto: no step-time model for {devices[0].platform} devices; "
            f"using 'wus'"
        )
        opt.update_sharding = "wus"
        return config, [], None
    thresholds = list(opt.auto.min_shard_bytes) or [opt.min_shard_bytes]
    unknown = [m for m in opt.auto.modes if m not in plan_lib.MODES]
    if unknown:
        raise ConfigError(f"optimizer.auto.modes: {unknown} not among {plan_lib.MODES}")

    def trial(mode: str, group: int, threshold: int) -> dict:
        config_ = config.copy_and_resolve_references()
        config_.optimizer.update(
            update_sharding=mode, shard_group_size=group, min_shard_bytes=threshold
        )
        row = analyze(config_, devices, unroll=unroll)
        log(_candidate_line(row))
        return row

    log(f"  {'candidate':<58} {'HBM/core':>12} {'':12} step, compiler-literal (optimistic)")
    floors = _hbm_floors(config, devices)
    capacity = compiler_hbm_budget(devices[0]) or hardware.lookup(devices[0].device_kind).hbm_bytes(
        _cores_per_chip(devices)
    )

    def fits_at_all(mode: str) -> bool:
        # Not compiled where what the mode must hold alone exceeds the HBM (minutes saved).
        if floors[mode][0] <= capacity:
            return True
        verdict = "NO STACKS" if math.isinf(floors[mode][0]) else "DOES NOT FIT"
        log(f"  {mode:<58} {'':>12} {verdict:<12} {floors[mode][1]}: not compiled")
        return False

    rows = [trial("none", 0, opt.min_shard_bytes)] if fits_at_all("none") else []
    gathers_whole = [m for m in ("wus", "fsdp") if m in opt.auto.modes and fits_at_all(m)]
    per_layer = "per_layer" in opt.auto.modes and fits_at_all("per_layer")
    for group in candidate_groups(config, devices):
        for threshold in thresholds:
            fit = False
            for mode in gathers_whole:
                if mode == "fsdp" and fit:
                    continue  # ZeRO-3 gathers twice: it only wins on memory
                rows.append(trial(mode, group, threshold))
                fit = fit or rows[-1]["fits"]
            # Layer by layer where gathering the stacks whole does not fit.
            if per_layer and not fit:
                rows.append(trial("per_layer", group, threshold))
    fitting = [r for r in rows if r["fits"]]
    if not fitting:
        least = min(rows, key=lambda r: r["hbm_bytes_per_core"], default=None)
        need = f"; the smallest needs {_gib(least['hbm_bytes_per_core']):.2f} GiB" if least else ""
        raise ConfigError(
            f"update_sharding=auto: no candidate fits the {_gib(capacity):.2f} GiB of HBM per "
            f"core{need}"
        )
    best = min(
        fitting,
        key=lambda r: (
            r["est_step_time_s"]["no_overlap"],
            r["est_step_time_s"]["by_assumption"]["optimistic"]["no_overlap"],
        ),
    )
    opt.update(
        update_sharding=best["mode"],
        shard_group_size=best["shard_group_size"],
        min_shard_bytes=best["min_shard_bytes"],
    )
    log(f"update_sharding=auto chose: {_candidate_name(best)}")
    return config, rows, best


def _cores_per_chip(devices: list) -> int:
    return len({getattr(d, "core_on_chip", 0) for d in devices})


def _hbm_floors(config, devices: list) -> dict[str, tuple[float, str]]:
    """Per mode, bytes a core must hold whatever else the program needs, and why:
    ``none`` its model-parallel share of the float32 weights and their gradient
    (8 bytes a parameter), ``wus`` and ``fsdp`` the weights gathered whole for the
    forward pass (in ``gather_dtype``), ``per_layer`` nothing more than its sharded
    state, and no candidate at all for a model without layer stacks."""
    model = experiment.build_model(config, devices=devices, with_data=False)
    model_ways = model.mesh.devices.size // mesh_lib.data_parallel_size(model.mesh)
    share = model.num_params / model_ways
    gathered = jax.numpy.dtype(config.optimizer.gather_dtype).itemsize * share
    stacks = any(jax.tree.leaves(model.layer_stacks))
    return {
        "none": (8 * share, f"float32 weights and gradients alone: {_gib(8 * share):.1f} GiB"),
        "wus": (gathered, f"the weights gathered whole alone: {_gib(gathered):.1f} GiB"),
        "fsdp": (gathered, f"the weights gathered whole alone: {_gib(gathered):.1f} GiB"),
        "per_layer": (0.0, "") if stacks else (math.inf, "no layer stack to gather"),
    }


def _candidate_name(r: dict) -> str:
    if r["mode"] == "none":
        return "none"
    group = r["shard_group_size"] or "all"
    return f"{r['mode']} (shard_group_size={group}, min_shard_bytes={r['min_shard_bytes']})"


def _candidate_line(r: dict) -> str:
    est = r["est_step_time_s"]
    fits = "fits" if r["fits"] else "DOES NOT FIT"
    optimistic = est["by_assumption"]["optimistic"]["no_overlap"]
    line = (
        f"  {_candidate_name(r):<58} {_gib(r['hbm_bytes_per_core']):8.2f} GiB {fits:<12} "
        f"{est['no_overlap'] * 1e3:8.2f} ms ({optimistic * 1e3:.2f})"
    )
    return line if r["mode"] == "none" else f"{line}\n      {r['groups']}"


def _gib(n: float) -> float:
    return n / 2**30
