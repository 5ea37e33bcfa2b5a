"""The hardware table, the MFU peak, HLO replica groups and the step-time model
(no compilation: synthetic collectives on a synthetic torus)."""

import dataclasses
import pathlib
import types

import numpy as np
import pytest

from trainer.analysis import compiled, costmodel, hlo, program
from trainer.analysis.hlo import Collective
from trainer.parallel import hardware

V3 = hardware.ACCELERATORS["v3"]
LIBTPU = pathlib.Path(__file__).parent / "libtpu"


def test_device_kinds_map_to_their_generation():
    kinds = {
        "TPU v2": "v2",
        "TPU v3": "v3",
        "TPU v4": "v4",
        "TPU v5 lite": "v5e",
        "TPU v5e": "v5e",
        "TPU v5": "v5p",
        "TPU v5p": "v5p",
        "TPU v6 lite": "v6e",
        "NVIDIA A100-SXM4-40GB": "a100-40gb",
        "NVIDIA A100-SXM4-80GB": "a100-80gb",
        "NVIDIA H100 80GB HBM3": "h100-sxm",
        "NVIDIA H100 PCIe": "h100-pcie",
        "NVIDIA H200": "h200",
    }
    for kind, name in kinds.items():
        assert hardware.lookup(kind).name == name, kind
    assert hardware.lookup("TPU v4 lite") is None
    assert hardware.lookup("cpu") is None


def _devices(x: int, y: int, cores: int = 2, kind: str = "TPU v3"):
    """Fake TPU devices of an x-by-y slice in JAX's id order (core fastest)."""
    return [
        types.SimpleNamespace(
            coords=(i, j, 0), core_on_chip=c, device_kind=kind, platform="tpu", id=n
        )
        for n, (j, i, c) in enumerate(
            (j, i, c) for j in range(y) for i in range(x) for c in range(cores)
        )
    ]


def test_per_device_figures_come_from_the_devices():
    # Cloud TPU v3: 123 TFLOPS and 32 GiB per chip; two JAX devices per chip.
    assert hardware.devices_per_chip(_devices(2, 2)) == 2
    assert V3.peak_flops(2) == 61.5e12
    assert V3.hbm_bytes(2) == 16 * 2**30
    # libtpu's v4 topology shows both cores unless asked for megacore: then one device.
    v4 = hardware.ACCELERATORS["v4"]
    assert hardware.devices_per_chip(_devices(4, 4, 1, "TPU v4")) == 1
    assert v4.peak_flops(1) == 275e12
    assert hardware.devices_per_chip(_devices(4, 4, 2, "TPU v4")) == 2
    assert hardware.ACCELERATORS["v5e"].hbm_bytes(1) == 16 * 2**30  # as libtpu sizes it
    assert (
        hardware.devices_per_chip([types.SimpleNamespace(platform="gpu", device_kind="H100")]) == 1
    )


@pytest.mark.parametrize(
    "name, chips, pod_allreduce_bytes_per_s",
    # Google's "all-reduce bandwidth per Pod" = chips x links x one-way link bandwidth.
    [("v3", 1024, 340e12), ("v4", 4096, 1.1e15), ("v5e", 256, 51.2e12), ("v6e", 256, 102.4e12)],
)
def test_link_bandwidth_agrees_with_published_pod_figures(name, chips, pod_allreduce_bytes_per_s):
    acc = hardware.ACCELERATORS[name]
    ours = chips * acc.ici_links_per_chip * acc.ici_link_bandwidth
    assert ours == pytest.approx(pod_allreduce_bytes_per_s, rel=0.03)


def test_peak_for_mfu_override_unknown_and_cpu(capsys):
    tpus = _devices(2, 2)
    assert hardware.peak_flops_per_device(tpus) == 61.5e12
    assert hardware.peak_flops_per_device(tpus, override=1e12) == 1e12
    odd = [types.SimpleNamespace(platform="gpu", device_kind="Some Future GPU")]
    assert hardware.peak_flops_per_device(odd) == 0.0
    assert hardware.peak_flops_per_device(odd) == 0.0
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1  # warned once only
    assert warned[0].startswith("warning: no peak FLOP/s known for device kind 'Some Future GPU'")

    # A CPU has no published peak: no MFU unless the run measures one (train.py).
    cpu = [types.SimpleNamespace(platform="cpu", device_kind="cpu")]
    assert hardware.peak_flops_per_device(cpu) == 0.0
    assert hardware.peak_flops_per_device(cpu, override=5e10) == 5e10


def test_replica_group_forms():
    line = "x = f32[4] all-reduce(y), replica_groups={{0,2},{1,3}}, to_apply=add"
    assert hlo.first_replica_group(line, 4) == (0, 2)
    line = "x = f32[4] all-reduce(y), replica_groups=[2,4]<=[8], to_apply=add"
    assert hlo.first_replica_group(line, 8) == (0, 1, 2, 3)
    line = "x = f32[4] all-reduce(y), replica_groups=[4,2]<=[2,4]T(1,0), to_apply=add"
    assert hlo.first_replica_group(line, 8) == (0, 4)
    line = "x = f32[4] all-reduce(y), replica_groups=mesh['a'=2,'b'=4] {'a'}, to_apply=add"
    assert hlo.first_replica_group(line, 8) == (0, 4)
    line = "x = f32[4] all-reduce(y), replica_groups=mesh['a'=2,'b'=4] {'a','b'}, to_apply=add"
    assert hlo.first_replica_group(line, 8) == tuple(range(8))
    line = "x = f32[4] all-reduce(y), to_apply=add"
    assert hlo.first_replica_group(line, 4) == (0, 1, 2, 3)


def _libtpu_programs(name: str) -> dict[str, list[str]]:
    """``tests/analysis/libtpu/<name>``: ``{program: [its HLO lines]}``."""
    programs: dict[str, list[str]] = {}
    with open(LIBTPU / name) as f:
        for line in f:
            if line.startswith("## "):
                current = programs.setdefault(line[3:].strip(), [])
            elif line.strip() and not line.startswith("#"):
                current.append(line)
    return programs


def test_libtpu_mesh_form_groups_equal_its_iota_form():
    """The same 15 programs compiled by libtpu twice: its default mesh form of the
    replica groups (with device_ids and sub-axes) and the iota form it prints with
    rgv3 off must decode to the same groups, member order included."""
    programs = _libtpu_programs("replica_groups.txt")
    assert len(programs) == 15
    for name, (mesh_form, iota_form) in programs.items():
        assert "replica_groups=mesh[" in mesh_form and "<=[" in iota_form, name
        np.testing.assert_array_equal(
            hlo.replica_groups(mesh_form, 32), hlo.replica_groups(iota_form, 32), err_msg=name
        )
    # Iota forms read by hand: [8,4]<=[4,8]T(1,0) groups the columns of a 4x8 array;
    # [16,2]<=[4,2,4]T(0,2,1) pairs ids 4 apart within each 8.
    column = "x = f32[4] all-reduce(y), replica_groups=[8,4]<=[4,8]T(1,0), to_apply=add"
    assert hlo.replica_groups(column, 32)[:2].tolist() == [[0, 8, 16, 24], [1, 9, 17, 25]]
    pairs = "x = f32[4] all-to-all(y), replica_groups=[16,2]<=[4,2,4]T(0,2,1), dimensions={0}"
    assert hlo.replica_groups(pairs, 32)[:3].tolist() == [[0, 4], [1, 5], [2, 6]]


def test_libtpu_algorithms_are_read():
    found = {
        name: hlo.Algorithm.of(line) for name, (line,) in _libtpu_programs("algorithms.txt").items()
    }
    expect = {
        "v3:4x4 reduce-scatter over rows of 8": (
            "SingleInputAllReduceScatterFusion",
            "StrategyRing",
            1,
            1,
            1,
        ),
        "v3:4x4 whole-slice all-reduce": (
            "RotatedPincerEmitter",
            "UniDirectionNDRingStrategy",
            4,
            2,
            2,
        ),
        "v5p:4x4x4 wrapped plane: 2-D reduce-scatter": (
            "SingleInputAllReduceScatterFusion",
            "StrategySubgroupND",
            2,
            2,
            2,
        ),
        "v5p:4x4x4 wrapped plane: 2-D all-gather": ("2DAllGatherOnMajorDim", "", 1, 1, 2),
        "v3:4x4 all-reduce over 8 (both directions)": (
            "RotatedPincerEmitter",
            "UniDirection1DRingStrategy",
            2,
            1,
            1,
        ),
    }
    for name, a in found.items():
        assert (a.emitter, a.strategy, a.colors, a.phases, a.dims) == expect[name], name
    assert hlo.Algorithm.of("x = f32[4] all-reduce(y), replica_groups={}") == hlo.Algorithm()


def test_async_start_ops_count_their_results_once():
    text = """HloModule m

ENTRY %main (p: bf16[2,8]) -> bf16[16,8] {
  %p = bf16[2,8]{1,0} parameter(0)
  %ags = (bf16[2,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%p), replica_groups=[1,8]<=[8]
  ROOT %agd = bf16[16,8]{1,0} all-gather-done(%ags)
}
"""
    (c,) = hlo.collectives(text, 8)
    assert (c.kind, c.dtype, c.result_bytes, c.is_async) == ("all-gather", "bf16", 256, True)


def test_fused_all_reduce_scatter_counts_as_a_reduce_scatter():
    config = '{"collective_algorithm_config":{"emitter":"SingleInputAllReduceScatterFusion"}}'
    text = """HloModule m

%ars (p: f32[64,8]) -> f32[16,8] {
  %p = f32[64,8]{1,0} parameter(0)
  %ar = f32[64,8]{1,0} all-reduce(%p), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %ds = f32[16,8]{1,0} dynamic-slice(%ar, %i, %j), dynamic_slice_sizes={16,8}
}

ENTRY %main (x: f32[64,8]) -> f32[16,8] {
  %x = f32[64,8]{1,0} parameter(0)
  ROOT %f = f32[16,8]{1,0} fusion(%x), kind=kCustom, calls=%ars, backend_config=CONFIG
}
""".replace("CONFIG", config)
    (c,) = hlo.collectives(text, 8)
    assert (c.kind, c.group_size, c.buffer_bytes) == ("reduce-scatter", 4, 64 * 8 * 4)
    assert c.emitter == "SingleInputAllReduceScatterFusion"


def _torus(x: int, y: int, cores: int = 2, kind: str = "TPU v3") -> costmodel.Topology:
    return costmodel.Topology.from_devices(hardware.lookup(kind), _devices(x, y, cores, kind))


def _coll(kind, size, group, algorithm=None, is_async=False, in_loop=True):
    algorithm = algorithm or hlo.Algorithm()
    return Collective(
        kind,
        "f32",
        size,
        len(group),
        in_loop,
        is_async,
        algorithm.emitter,
        tuple(group),
        algorithm=algorithm,
    )


RING = hlo.Algorithm("SingleInputAllReduceScatterFusion", "StrategyRing", 1, 1, 1)


def test_a_ring_on_a_wrapped_row_runs_both_ways_round():
    pod = _torus(32, 32)
    assert pod.wraps == (True, True) and pod.cores_per_chip == 2
    row = list(range(64))  # chips (0..31, 0), both cores of each, in JAX's order
    size = 2**30
    scatter = _coll("reduce-scatter", size // 64, row, RING)
    # libtpu's StrategyRing sends half the shards each way round the row (its LLO:
    # cw and ccw DMAs, 32 steps): each member's 63/64 of the buffer, half over each
    # direction of the 656 Gbit/s links (the wrap-around link closes the ring).
    transfer = 63 / 64 * size / (2 * V3.ici_link_bandwidth)
    assert costmodel.reading(scatter).both_ways
    assert costmodel.collective_seconds(scatter, pod) == pytest.approx(transfer)
    assert costmodel.collective_seconds(scatter, pod, "bidirectional") == pytest.approx(transfer)
    # A one-way ring (an algorithm with no reading) takes twice as long.
    unread = _coll("reduce-scatter", size // 64, row, hlo.Algorithm("SomethingNew"))
    assert "assumed one one-way ring" in costmodel.reading(unread).note
    assert costmodel.collective_seconds(unread, pod) == pytest.approx(2 * transfer)
    # Latency added rather than hidden: 32 steps of one hop, and the fixed 5 us.
    pessimistic = costmodel.collective_seconds(scatter, pod, "pessimistic")
    hop = costmodel.HOP_LATENCY_S
    assert pessimistic == pytest.approx(transfer + 32 * hop + costmodel.FIXED_LATENCY_S)
    # An all-reduce is a reduce-scatter then an all-gather.
    reduce = dataclasses.replace(scatter, kind="all-reduce", result_bytes=size)
    assert costmodel.collective_seconds(reduce, pod) == pytest.approx(2 * transfer)


def test_a_ring_through_a_block_pays_its_long_hop():
    # mesh_utils' old groups: a 16x2 block of chips in 2x2 sub-blocks; the ring closes
    # with a 16-hop step (15 along x, 1 along y), and every step of the ring waits for it.
    pod = _torus(32, 32)
    order = []
    for i in range(0, 16, 2):
        for x, y in ((i, 0), (i + 1, 0), (i, 1), (i + 1, 1)):
            order += [2 * (x + 32 * y), 2 * (x + 32 * y) + 1]
    small = _coll("reduce-scatter", 2**12, order, RING)  # latency-bound
    row = _coll("reduce-scatter", 2**12, list(range(64)), RING)
    block = costmodel.collective_seconds(small, pod)
    assert block == pytest.approx(32 * 16 * costmodel.HOP_LATENCY_S)
    assert costmodel.collective_seconds(row, pod) == pytest.approx(32 * costmodel.HOP_LATENCY_S)


def test_assumptions_are_ordered_and_nd_algorithms_run_by_phases():
    pod = _torus(32, 32)
    nd = hlo.Algorithm("RotatedPincerEmitter", "StrategyND", 1, 2, 2)
    everyone = _coll("all-reduce", 2**30, range(2048), nd)
    seconds = [costmodel.collective_seconds(everyone, pod, a) for a in costmodel.ASSUMPTIONS]
    assert seconds == sorted(seconds)
    link = V3.ici_link_bandwidth
    # Optimistic: both torus dimensions both ways, the scaling book's 2 V / (W_bidi x 2).
    assert seconds[0] == pytest.approx(2 * 1023 / 1024 * 2**30 / (4 * link))
    # Compiler-literal: rings of 64 cores on 32 chips, then of 32 chips on what is left,
    # each both ways round (the LLO of StrategyND{colors:1 phases:2 cores:{64 32}}).
    first = 63 / 64 * 2**30 / (2 * link)
    second = 31 / 32 * 2**30 / 64 / (2 * link)
    assert seconds[2] == pytest.approx(2 * (first + second))
    # The cores of one chip only copy through HBM.
    same_chip = costmodel.collective_seconds(_coll("all-reduce", 2**30, [0, 1]), pod)
    assert same_chip == pytest.approx(2**30 / V3.hbm_bandwidth(2))


def test_a_line_gains_nothing_both_ways_and_chips_share_links():
    small = _torus(4, 4)
    assert small.wraps == (False, False)  # a 4x4 slice of a 32x32 pod has no wrap-around
    # A row of 4 chips without wrap-around: the ring closes with a 3-hop message back
    # over the same links, so running it both ways loads each link direction twice:
    # no faster than one way, in ceil(7/2) = 4 steps of 3 hops (libtpu's LLO: 4 + 3
    # shards, the closing message 3 hops).
    size = 2**28
    row = _coll("reduce-scatter", size // 8, list(range(8)), RING)
    assert costmodel.collective_seconds(row, small) == pytest.approx(
        7 / 8 * size / V3.ici_link_bandwidth
    )
    latency_bound = _coll("reduce-scatter", 2**9, list(range(8)), RING)
    assert costmodel.collective_seconds(latency_bound, small) == pytest.approx(
        4 * 3 * costmodel.HOP_LATENCY_S
    )
    # One core of each chip of a row: the other cores run their own ring on the same
    # links, so each gets half of them.
    pod = _torus(32, 32)
    half = _coll("all-gather", size, [2 * i for i in range(32)], RING)
    assert costmodel.collective_seconds(half, pod) == pytest.approx(
        31 / 32 * size / (2 * V3.ici_link_bandwidth / 2)
    )


def test_the_2d_all_gather_carries_half_again_over_the_chips():
    pod = _torus(32, 32)
    row = list(range(64))
    gather = hlo.Algorithm("2DAllGatherOnMajorDim", "", 1, 1, 2)
    big = _coll("all-gather", 2**26, row, gather)  # 1 MiB shards
    small = _coll("all-gather", 64 * 2**12, row, gather)  # 4 KiB shards
    assert costmodel.reading(big).bytes_factor == 1.5
    assert costmodel.reading(small).bytes_factor == 1.0
    # The row is one torus dimension with the cores of each chip: one ring phase.
    assert costmodel.collective_seconds(big, pod) == pytest.approx(
        1.5 * 63 / 64 * 2**26 / (2 * V3.ici_link_bandwidth)
    )
    assert costmodel.reading(big).steps_of(64) == 62 and costmodel.reading(small).steps_of(64) == 32


def test_step_estimate_bounds():
    pod = _torus(4, 4)
    # In the 10-step loop a collective runs 10 times a call (once a step); outside it,
    # once per call of the program (once per 10 steps).
    colls = [
        dataclasses.replace(_coll("all-reduce", 2**26, range(32)), trips=10),
        dataclasses.replace(
            _coll("all-gather", 2**25, range(32), is_async=True),
            name="all-gather-start.1",
            trips=10,
        ),
        _coll("all-reduce", 2**26, range(32), in_loop=False),
    ]
    compute = costmodel.roofline_seconds(1e12, 1e9, V3, 2)
    assert compute == pytest.approx(max(1e12 / 61.5e12, 1e9 / 450e9))
    est, secs = costmodel.estimate_step(
        compute_s=compute,
        collectives=colls,
        topo=pod,
        steps_per_loop=10,
        has_loop=True,
        windows_s={"all-gather-start.1": 1e-4},  # 0.1 ms of work while it runs
    )
    assert est.compute_s == compute
    assert secs[2] == pytest.approx(secs[0] / 10)
    assert est.sync_collective_s == pytest.approx(secs[0] + secs[2])
    assert est.async_collective_s == pytest.approx(secs[1])
    assert est.hidden_s == pytest.approx(min(secs[1], 1e-4)) and est.hidden_s > 0
    assert est.overlap_s == pytest.approx(compute + sum(secs) - est.hidden_s)
    assert est.no_overlap_s == pytest.approx(est.compute_s + sum(secs))
    assert est.overlap_s < est.no_overlap_s
    more = dataclasses.replace(colls[0], result_bytes=2**27)
    bigger, _ = costmodel.estimate_step(
        compute_s=compute,
        collectives=[more, *colls[1:]],
        topo=pod,
        steps_per_loop=10,
        has_loop=True,
    )
    assert bigger.no_overlap_s > est.no_overlap_s


def test_an_async_collective_overlaps_what_the_schedule_runs_meanwhile():
    # A start/done pair around a fusion that moves 3 MiB; a fused gather (XLA's async
    # collective fusion) counted once, overlapping its kernel's own bytes.
    text = """HloModule m, is_scheduled=true

%fused_start (p0: bf16[64,1024]) -> bf16[512,1024] {
  %p0 = bf16[64,1024]{1,0} parameter(0)
  ROOT %ag0 = bf16[512,1024]{1,0} all-gather(%p0), replica_groups=[1,8]<=[8], dimensions={0}
}

%async_collective_fusion.1 (p1: bf16[64,1024], w: bf16[512,1024]) -> bf16[512,512] {
  %p1 = bf16[64,1024]{1,0} parameter(0)
  %w = bf16[512,1024]{1,0} parameter(1)
  %ag = bf16[512,1024]{1,0} all-gather(%p1), replica_groups=[1,8]<=[8], dimensions={0}
  ROOT %mm = bf16[512,512]{1,0} convolution(%w, %w), dim_labels=bf_oi->bf
}

ENTRY %main (x: f32[512,512], s: bf16[64,1024], w: bf16[512,1024]) -> f32[512,512] {
  %x = f32[512,512]{1,0} parameter(0)
  %s = bf16[64,1024]{1,0} parameter(1)
  %w = bf16[512,1024]{1,0} parameter(2)
  %ags = (bf16[64,1024]{1,0}, bf16[512,1024]{1,0}) all-gather-start(%s), replica_groups=[1,8]<=[8]
  %f = f32[512,512]{1,0} fusion(%x), kind=kLoop, calls=%body
  %agd = bf16[512,1024]{1,0} all-gather-done(%ags)
  %async-collective-start = bf16[512,1024]{1,0} fusion(%s), calls=%fused_start
  %k = bf16[512,512]{1,0} fusion(%s, %w), kind=kCustom, calls=%async_collective_fusion.1
  ROOT %r = f32[512,512]{1,0} add(%f, %f)
}
"""
    found = hlo.collectives(text, 8)
    kinds = [(c.name, c.is_async, c.fused_with) for c in found if c.kind == "all-gather"]
    # The gather of the start fusion is its bookkeeping, not a second collective.
    assert sorted(kinds) == [("ag", True, ("k",)), ("ags", True, ())]
    # Each kernel timed by its roofline on v5e: the fusion between the start and the done
    # by its bytes (its operand and result; no matmul); the fused gather's kernel by
    # the longer of its matmul (2 x 512 x 512 x 1024 FLOPs) and its bytes.
    v5e = hardware.ACCELERATORS["v5e"]
    windows = program.window_seconds(text, found, v5e)
    assert windows["ags"] == pytest.approx(2 * 512 * 512 * 4 / v5e.hbm_bandwidth())
    kernel_bytes = 512 * 512 * 2 + 64 * 1024 * 2 + 512 * 1024 * 2
    assert windows["ag"] == pytest.approx(
        max(2 * 512 * 512 * 1024 / v5e.peak_flops(), kernel_bytes / v5e.hbm_bandwidth())
    )


# A hand-made chain of libtpu 0.0.52's async collective fusion (its header says what).
_CHAIN = (LIBTPU / "async_chain.txt").read_text()


def test_an_async_chain_is_one_transfer():
    found = hlo.collectives(_CHAIN, 8)
    gathers = [c for c in found if c.kind == "all-gather"]
    # Two gathers a trip, not five: the chain's four pieces are one, the plain one another.
    assert len(gathers) == 2
    chained, plain = sorted(gathers, key=lambda c: c.chain, reverse=True)
    assert (chained.chain, chained.is_async, chained.fused_with) == (
        "7",
        True,
        ("fusion.1", "fusion.2"),
    )
    assert (chained.buffer_bytes, chained.group_size, chained.trips) == (512 * 1024 * 2, 8, 4)
    assert (plain.chain, plain.is_async, plain.buffer_bytes, plain.group_size) == (
        "",
        False,
        256 * 1024 * 2,
        4,
    )
    # Per 4-trip run: the chain's 1 MiB four times, not 4 x 4 MiB.
    assert sum(c.buffer_bytes * c.trips for c in gathers) == 4 * (2**20 + 2**19)
    # It overlaps the work of both kernels: each reads its shard (128 KiB) and its
    # matmul operand (512 KiB) and writes its tuple (512 KiB + 1 MiB).
    kernel = 64 * 1024 * 2 + 512 * 512 * 2 + 512 * 512 * 2 + 512 * 1024 * 2
    # Timed, each kernel takes the longer of its matmul (2 x 512^3 FLOPs) at the v5e
    # peak and its bytes at the v5e bandwidth.
    v5e = hardware.ACCELERATORS["v5e"]
    each = max(2 * 512**3 / v5e.peak_flops(), kernel / v5e.hbm_bandwidth())
    seconds = program.window_seconds(_CHAIN, found, v5e)
    assert seconds == {chained.name: pytest.approx(2 * each)}


def _send(attributes: str) -> str:
    # A megascale send as libtpu 0.0.42.1 prints it (v5e:16x16 x 2), attributes varied.
    return (
        "  %send.67 = (f32[1024,256]{1,0}, u32[], token[]) send(%all-reduce.506, "
        "%after-all.68), channel_id=3, is_host_transfer=true, frontend_attributes={"
        '_xla_host_transfer_handler_name="xla_megascale_runtime",' + attributes + "}"
    )


def test_dcn_sends_say_which_fields_they_did_not_print():
    printed = _send(
        '_xla_megascale_target="{1,2,3}x{0:255}",_xla_megascale_transfer_type="ALL_REDUCE"'
    )
    bare = _send('_xla_megascale_reduce_operation="SUM"')
    text = "ENTRY %main () -> f32[] {\n" + printed + "\n" + bare + "\n}\n"
    full, missing = hlo.dcn_transfers(text, num_slices=4)
    assert (full.kind, full.bytes, full.slices, full.assumed) == (
        "ALL_REDUCE",
        1024 * 256 * 4,
        3,
        (),
    )
    assert full.wire_bytes == 2 * (2 / 3) * 1024 * 256 * 4  # an all-reduce over 3 slices
    assert (missing.kind, missing.slices) == ("?", 4)
    assert missing.assumed == (
        "kind: not printed",
        "slices: no target list printed, taken as all 4",
    )


def test_a_multi_slice_programs_compute_is_its_kernels_roofline_at_least():
    # XLA's optimal_seconds of a multi-slice program is negative; the compute is then
    # the whole program's roofline (with the FLOPs XLA leaves out, at peak), or the sum
    # of its kernels' rooflines where that is longer, as it always is when complete:
    # v5p-32b-2slices, 8.77 s against 9.67 s.
    v5p = hardware.lookup("TPU v5")
    peak = v5p.peak_flops(1)
    cost = types.SimpleNamespace(
        optimal_seconds=-30.5, uncosted_flops=0.5 * peak, matmul_shortfall_flops=0.25 * peak
    )
    assert compiled._compute(cost, 8.77, 9.67, v5p, 1) == ("roofline", 9.67)
    assert compiled._compute(cost, 8.77, 8.0, v5p, 1) == ("roofline", pytest.approx(8.77 + 0.75))
    xla = types.SimpleNamespace(**{**vars(cost), "optimal_seconds": 11.0})  # one slice
    assert compiled._compute(xla, 8.77, 9.67, v5p, 1) == ("xla", pytest.approx(11.75))
