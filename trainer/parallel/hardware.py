"""Published figures of accelerator generations, looked up by ``jax.Device.device_kind``.

One row per generation, every figure with its source, per chip as vendors
publish them. How many JAX devices share a chip is not in the table: it comes
from the devices (:func:`devices_per_chip`, through :mod:`trainer.parallel.torus`): two
TensorCores are two devices on v2/v3, one "megacore" device on v4/v5p as JAX
runs them (libtpu's compile-only ``v4`` topology shows two unless asked for
megacore), one on v5e/v6e, one per GPU. The per-device figures divide by it.
Where each TPU generation's torus wraps around is :mod:`trainer.parallel.torus`'s.

Used for MFU (peak bf16 FLOP/s per device), for the HBM fit check and for the
step-time estimate of :mod:`trainer.aot` (HBM and ICI bandwidth).

Sources (abbreviated in the table):

* [CACM20] Jouppi et al., "A Domain-Specific Supercomputer for Training Deep
  Neural Networks", CACM 63(7), 2020, Table 3 (TPUv2 / TPUv3 chips).
* [TPUv3] https://cloud.google.com/tpu/docs/v3 (key specifications).
* [TPUv4] https://cloud.google.com/tpu/docs/v4 (key specifications).
* [TPUv5e] https://cloud.google.com/tpu/docs/v5e (key chip specifications).
* [TPUv5p] https://cloud.google.com/tpu/docs/v5p (key specifications).
* [TPUv6e] https://cloud.google.com/tpu/docs/v6e (key specifications).
* [A100] NVIDIA A100 Tensor Core GPU datasheet (SXM4: BF16 312 TFLOPS dense,
  624 with sparsity; 40 GB HBM2 1,555 GB/s or 80 GB HBM2e 2,039 GB/s; NVLink
  600 GB/s).
* [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 TFLOPS with
  sparsity = 989.5 dense, 80 GB, 3.35 TB/s, NVLink 900 GB/s; PCIe: 1,513 with
  sparsity = 756.5 dense, 80 GB, 2 TB/s).
* [H200] NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with
  sparsity = 989.5 dense, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s).

DCN (the data-center network between slices) bandwidth is kept as bytes/s per chip,
a (low, high) range: equal where Google publishes it, a named assumption where not
(cost figures say which):

* v5e: "Data center network bandwidth per Pod | 6.4 Tbps" over 256 chips (and "2 x
  100 Gbps NIC" per 8-chip host) = 25 Gbit/s per chip [TPUv5e];
* v5p: "Data center network (DCN) bandwidth per chip (Gbps) | 50" [TPUv5p];
* v6e: "Data center network bandwidth per Pod | 25.6 Tbps" over 256 chips =
  100 Gbit/s per chip [TPUv6e]; the scaling book ("How to think about TPUs") has
  the same three per-chip figures (3.125e9, 6.25e9, 12.5e9 B/s, egress);
* v4 (no DCN figure published; multislice runs on v4) and v3 (Cloud multislice is
  v4 and later; the MLPerf v0.7 multipod joined v3 pods by cross-pod ICI links, not
  the DCN): assumed 25-50 Gbit/s per chip, from v5e's published figure to v5p's
  (which equals the scaling book's older "2.5e10 bytes / second per host" over a
  4-chip host).

ICI bandwidth is kept as one-way bytes/s per link. Google publishes it in three
ways; all agree with the per-link figure used here: per link [CACM20]; per chip
"bidirectional" (= links x 2 x one-way) [TPUv5e/v5p/v6e]; and "all-reduce
bandwidth per Pod" (= chips x links x one-way): v3 340 TB/s / 1024 chips / 4
links = 83 GB/s vs 656 Gbit/s = 82 GB/s [CACM20]; v4 1.1 PB/s / 4096 / 6 =
45 GB/s; v5e 51.2 TB/s / 256 / 4 = 50 GB/s; v6e 102.4 TB/s / 256 / 4 = 100 GB/s.
"""

from __future__ import annotations

import dataclasses
import time

from trainer import console
from trainer.parallel import torus

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator generation, per chip as published.

    Attributes:
      name: short name (``v3``, ``h100``).
      hbm_bytes_per_chip: HBM capacity of a chip.
      hbm_bandwidth_per_chip: HBM bytes/s of a chip.
      peak_bf16_flops_per_chip: dense bf16 matmul FLOP/s of a chip.
      ici_links_per_chip: inter-chip links of a chip (TPU ICI; 0 for GPUs).
      ici_link_bandwidth: one-way bytes/s of one link.
      source: the references of this row (see the module docstring).
      dcn_bandwidth_per_chip: (low, high) bytes/s a chip sends over the DCN: the
        published figure twice, or an assumed range (``dcn_assumed``).
      dcn_assumed: whether that range is an assumption (no published figure).
    """

    name: str
    hbm_bytes_per_chip: float
    hbm_bandwidth_per_chip: float
    peak_bf16_flops_per_chip: float
    ici_links_per_chip: int = 0
    ici_link_bandwidth: float = 0.0
    source: str = ""
    dcn_bandwidth_per_chip: tuple[float, float] = (0.0, 0.0)
    dcn_assumed: bool = False

    def hbm_bytes(self, devices_per_chip: int = 1) -> float:
        """HBM capacity of one JAX device."""
        return self.hbm_bytes_per_chip / devices_per_chip

    def hbm_bandwidth(self, devices_per_chip: int = 1) -> float:
        """HBM bytes/s of one JAX device."""
        return self.hbm_bandwidth_per_chip / devices_per_chip

    def peak_flops(self, devices_per_chip: int = 1) -> float:
        """Peak dense bf16 FLOP/s of one JAX device."""
        return self.peak_bf16_flops_per_chip / devices_per_chip


# DCN bytes/s per chip where Google publishes none: v5e's 25 to v5p's 50 Gbit/s.
_DCN_ASSUMED = (25e9 / 8, 50e9 / 8)

_TABLE = (
    # TPU v2: 46 TFLOPS, 16 GiB, 700 GB/s, 4 ICI links x 496 Gbit/s, 2-D torus [CACM20].
    Accelerator("v2", 16 * GIB, 700 * GB, 46e12, 4, 496e9 / 8, "CACM20"),
    # TPU v3: 123 TFLOPS, 32 GiB, 900 GB/s, 2-D torus [TPUv3]; 4 ICI links x 656
    # Gbit/s [CACM20] (the scaling book's table says 1e11 B/s one way, 22% more).
    Accelerator(
        "v3", 32 * GIB, 900 * GB, 123e12, 4, 656e9 / 8, "TPUv3, CACM20", _DCN_ASSUMED, True
    ),
    # TPU v4: 275 TFLOPS, 32 GiB, 1200 GB/s, 3-D torus, 1.1 PB/s all-reduce bandwidth
    # over 4096 chips x 6 links [TPUv4].
    Accelerator(
        "v4", 32 * GIB, 1200 * GB, 275e12, 6, 1.1e15 / 4096 / 6, "TPUv4", _DCN_ASSUMED, True
    ),
    # TPU v5e: 197 TFLOPS, 16 GB, 819 GB/s, 400 GB/s bidirectional ICI per chip over
    # 4 ports, 2-D torus, 256-chip pod (16 x 16) [TPUv5e]. The "16 GB" are 16 GiB: the
    # TPU compiler (libtpu 0.0.42.1) refuses a v5e:16x16 buffer as one that "would exceed
    # memory (size=17179869184)", and budgets 15.75 GiB of it for a program.
    Accelerator("v5e", 16 * GIB, 819 * GB, 197e12, 4, 400 * GB / 8, "TPUv5e", (25e9 / 8,) * 2),
    # TPU v5p: 459 TFLOPS, 95 GiB, 2575 GiB/s, 1200 GB/s bidirectional ICI per chip
    # over 6 links, 3-D torus [TPUv5p].
    Accelerator("v5p", 95 * GIB, 2575 * GIB, 459e12, 6, 1200 * GB / 12, "TPUv5p", (50e9 / 8,) * 2),
    # TPU v6e: 918 TFLOPS, 32 GB, 1640 GB/s, 800 GB/s bidirectional ICI per chip over
    # 4 ports, 2-D torus, 256-chip pod (16 x 16) [TPUv6e].
    Accelerator("v6e", 32 * GB, 1640 * GB, 918e12, 4, 800 * GB / 8, "TPUv6e", (100e9 / 8,) * 2),
    Accelerator("a100-40gb", 40 * GB, 1555 * GB, 312e12, source="A100"),
    Accelerator("a100-80gb", 80 * GB, 2039 * GB, 312e12, source="A100"),
    Accelerator("h100-sxm", 80 * GB, 3350 * GB, 989.5e12, source="H100"),
    Accelerator("h100-pcie", 80 * GB, 2000 * GB, 756.5e12, source="H100"),
    Accelerator("h200", 141 * GB, 4800 * GB, 989.5e12, source="H200"),
)
ACCELERATORS = {a.name: a for a in _TABLE}

# GPU device_kind substrings, most specific first (TPU kinds: trainer.parallel.torus).
_GPU_KINDS = (
    ("A100-SXM4-40GB", "a100-40gb"),
    ("A100-PCIE-40GB", "a100-40gb"),
    ("A100", "a100-80gb"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("H200", "h200"),
)


def lookup(device_kind: str) -> Accelerator | None:
    """The table row of a ``jax.Device.device_kind``, or None if unknown."""
    tpu = torus.generation(device_kind)
    if tpu is not None:
        return ACCELERATORS[tpu.name]
    for pattern, name in _GPU_KINDS:
        if pattern in device_kind:
            return ACCELERATORS[name]
    return None


def devices_per_chip(devices) -> int:
    """How many of ``devices`` share a chip (TPU cores run as separate devices); 1 for
    GPUs and CPUs."""
    slice_ = torus.Torus.of(list(devices))
    return slice_.cores_per_chip if slice_ is not None else 1


_warned: set[str] = set()


def peak_flops_per_device(devices, override: float = 0.0) -> float:
    """Peak FLOP/s of one of ``devices`` for MFU, or 0.0 when unknown (MFU left out).

    Args:
      devices: the run's ``jax.Device`` list (how many share a chip matters).
      override: ``config.peak_flops_per_device``; used as is when > 0.

    TPUs and GPUs come from the table. A CPU has no published peak to go by: 0.0
    (a run measures one only when asked, ``config.measure_cpu_peak``, and says
    so: a figure measured under whatever load the machine had is not a constant).
    An accelerator the table does not know warns once and gives 0.0.
    """
    if override > 0:
        return float(override)
    device = devices[0]
    if device.platform == "cpu":
        return 0.0
    row = lookup(device.device_kind)
    if row is None:
        if device.device_kind not in _warned:
            _warned.add(device.device_kind)
            console.warn(
                f"no peak FLOP/s known for device kind '{device.device_kind}': MFU is left "
                f"out; set config.peak_flops_per_device to report it"
            )
        return 0.0
    return row.peak_flops(devices_per_chip(devices))


def measure_matmul_peak(dtype: str = "float32", n: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of all devices together on one big batched matmul per device."""
    import jax  # noqa: PLC0415  (jax is imported on use: the table needs none)
    import jax.numpy as jnp  # noqa: PLC0415
    from jax.sharding import NamedSharding, PartitionSpec  # noqa: PLC0415

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("d",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, PartitionSpec("d"))
    x = jax.device_put(jnp.ones((len(devices), n, n), dtype), sharding)
    matmul = jax.jit(lambda a: jnp.einsum("bij,bjk->bik", a, a), out_shardings=sharding)
    matmul(x).block_until_ready()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        matmul(x).block_until_ready()
        times.append(time.perf_counter() - start)
    return 2 * n**3 * len(devices) / min(times)
