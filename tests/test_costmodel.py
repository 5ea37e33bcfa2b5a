"""The hardware table, the MFU peak, HLO replica groups and the step-time model
(no compilation: synthetic collectives on a synthetic torus)."""

import dataclasses
import types

import pytest

from trainer import costmodel, hardware, hlo
from trainer.hlo import Collective

V3 = hardware.ACCELERATORS["v3"]


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


def test_per_device_figures_split_two_core_chips():
    # Cloud TPU v3: 123 TFLOPS and 32 GiB per chip, two JAX devices per chip.
    assert V3.peak_flops == 61.5e12
    assert V3.hbm_bytes == 16 * 2**30
    assert hardware.ACCELERATORS["v4"].peak_flops == 275e12  # megacore: one device
    assert hardware.ACCELERATORS["v5e"].hbm_bytes == 16e9


@pytest.mark.parametrize(
    "name, chips, pod_allreduce_bytes_per_s",
    # Google's "all-reduce bandwidth per Pod" = chips x links x one-way link bandwidth.
    [("v3", 1024, 340e12), ("v4", 4096, 1.1e15), ("v5e", 256, 51.2e12), ("v6e", 256, 102.4e12)],
)
def test_link_bandwidth_agrees_with_published_pod_figures(name, chips, pod_allreduce_bytes_per_s):
    acc = hardware.ACCELERATORS[name]
    ours = chips * acc.ici_links_per_chip * acc.ici_link_bandwidth
    assert ours == pytest.approx(pod_allreduce_bytes_per_s, rel=0.03)


def test_peak_for_mfu_override_unknown_and_cpu(tmp_path, monkeypatch, capsys):
    tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v3")
    assert hardware.peak_flops_per_device(tpu) == 61.5e12
    assert hardware.peak_flops_per_device(tpu, override=1e12) == 1e12
    odd = types.SimpleNamespace(platform="gpu", device_kind="Some Future GPU")
    assert hardware.peak_flops_per_device(odd) == 0.0
    assert hardware.peak_flops_per_device(odd) == 0.0
    warned = capsys.readouterr().err.splitlines()
    assert len(warned) == 1  # warned once only
    assert warned[0].startswith("warning: no peak FLOP/s known for device kind 'Some Future GPU'")

    calls = []

    def fake_measure(dtype):
        calls.append(dtype)
        return 8e11

    monkeypatch.setattr(hardware, "measure_matmul_peak", fake_measure)
    cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
    assert hardware.peak_flops_per_device(cpu) == 0.0  # no cache dir: MFU left out
    first = hardware.peak_flops_per_device(cpu, cache_dir=str(tmp_path))
    again = hardware.peak_flops_per_device(cpu, cache_dir=str(tmp_path))
    assert first == again == 8e11 / 8  # per device of the 8 simulated ones
    assert calls == ["float32"]  # measured once, then read from the cache
    assert (tmp_path / "cpu_peak.json").exists()


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


def _torus(x: int, y: int, cores: int = 2) -> costmodel.Topology:
    devices = [
        types.SimpleNamespace(coords=(i, j, 0))
        for j in range(y)
        for i in range(x)
        for _ in range(cores)
    ]
    return costmodel.Topology.from_devices(V3, devices)


def _coll(kind, size, group, emitter="RotatedPincerEmitter", is_async=False, in_loop=True):
    return Collective(kind, "f32", size, len(group), in_loop, is_async, emitter, tuple(group))


def test_collective_formulas():
    pod = _torus(32, 32)
    assert pod.wraps == (True, True)
    everyone = range(2048)
    size = 2**30
    gather = costmodel.collective_seconds(_coll("all-gather", size, everyone), pod)
    reduce = costmodel.collective_seconds(_coll("all-reduce", size, everyone), pod)
    # Two torus dims, each a bidirectional ring of 656 Gbit/s links; 1024 chips.
    assert gather == pytest.approx(1023 / 1024 * size / (4 * V3.ici_link_bandwidth))
    assert reduce == pytest.approx(2 * gather)
    scatter = _coll("reduce-scatter", size // 2048, everyone)
    assert costmodel.collective_seconds(scatter, pod) == pytest.approx(gather)
    # A 1-D emitter drives one dim: half the bandwidth of two.
    one_d = _coll("all-gather", size, everyone, emitter="1DAllGatherOnMajorDimImbalanced")
    assert costmodel.collective_seconds(one_d, pod) == pytest.approx(2 * gather)
    # More bytes, more time; the two cores of one chip only copy through HBM.
    assert costmodel.collective_seconds(_coll("all-reduce", 2 * size, everyone), pod) > reduce
    same_chip = costmodel.collective_seconds(_coll("all-reduce", size, [0, 1]), pod)
    assert same_chip == pytest.approx(size / V3.hbm_bandwidth)


def test_groups_line_vs_ring_and_shared_chips():
    small = _torus(4, 4)
    assert small.wraps == (False, False)  # a 4x4 slice of a 32x32 pod has no wraparound
    size = 2**28
    whole = costmodel.collective_seconds(_coll("all-gather", size, range(32)), small)
    # 16 chips over two line dims at one link each way.
    assert whole == pytest.approx(15 / 16 * size / (2 * V3.ici_link_bandwidth))
    pod = _torus(32, 32)
    # One core of each chip of the first row: the chips' other cores are in other
    # groups, so each group gets half the links of the 32-chip ring.
    row = [2 * i for i in range(32)]
    part = costmodel.collective_seconds(_coll("all-gather", size, row), pod)
    assert part == pytest.approx(31 / 32 * size / (2 * V3.ici_link_bandwidth) * 2)


def test_step_estimate_bounds():
    pod = _torus(4, 4)
    colls = [
        _coll("all-reduce", 2**26, range(32)),
        _coll("all-gather", 2**25, range(32), is_async=True),
        _coll("all-reduce", 2**26, range(32), in_loop=False),  # once per K steps
    ]
    compute = costmodel.roofline_seconds(1e12, 1e9, V3)
    assert compute == pytest.approx(max(1e12 / 61.5e12, 1e9 / 450e9))
    est, secs = costmodel.estimate_step(
        compute_s=compute, collectives=colls, topo=pod, steps_per_loop=10, has_loop=True
    )
    assert est.compute_s == compute
    assert secs[2] == pytest.approx(secs[0] / 10)
    assert est.sync_collective_s == pytest.approx(secs[0] + secs[2])
    assert est.async_collective_s == pytest.approx(secs[1])
    assert est.overlap_s == pytest.approx(max(est.compute_s, secs[1]) + secs[0] + secs[2])
    assert est.no_overlap_s == pytest.approx(est.compute_s + sum(secs))
    assert est.overlap_s <= est.no_overlap_s
    more = dataclasses.replace(colls[0], result_bytes=2**27)
    bigger, _ = costmodel.estimate_step(
        compute_s=compute,
        collectives=[more, *colls[1:]],
        topo=pod,
        steps_per_loop=10,
        has_loop=True,
    )
    assert bigger.no_overlap_s > est.no_overlap_s
