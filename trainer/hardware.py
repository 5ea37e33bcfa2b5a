"""Published figures of accelerator generations, looked up by ``jax.Device.device_kind``.

One row per generation, every figure with its source. JAX exposes one device per
TensorCore on TPU v2/v3 (two per chip), one per chip on v4/v5p (the two cores act
as one "megacore") and on v5e/v6e (one core per chip), one per GPU. Vendors
publish per-chip figures; :class:`Accelerator` keeps them per chip and derives
the per-device ones, so the two are never confused.

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

ICI bandwidth is kept as one-way bytes/s per link. Google publishes it in three
ways; all agree with the per-link figure used here: per link [CACM20]; per chip
"bidirectional" (= links x 2 x one-way) [TPUv5e/v5p/v6e]; and "all-reduce
bandwidth per Pod" (= chips x links x one-way): v3 340 TB/s / 1024 chips / 4
links = 83 GB/s vs 656 Gbit/s = 82 GB/s [CACM20]; v4 1.1 PB/s / 4096 / 6 =
45 GB/s; v5e 51.2 TB/s / 256 / 4 = 50 GB/s; v6e 102.4 TB/s / 256 / 4 = 100 GB/s.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from trainer import errors

GIB = 2**30
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One accelerator generation, per chip as published.

    Attributes:
      name: short name (``v3``, ``h100``).
      devices_per_chip: JAX devices one chip exposes.
      hbm_bytes_per_chip: HBM capacity of a chip.
      hbm_bandwidth_per_chip: HBM bytes/s of a chip.
      peak_bf16_flops_per_chip: dense bf16 matmul FLOP/s of a chip.
      ici_links_per_chip: inter-chip links of a chip (TPU ICI; 0 for GPUs).
      ici_link_bandwidth: one-way bytes/s of one link.
      torus_dims: dimensions of the pod's torus (2 or 3; 0 for GPUs).
      pod_shape: chips along each torus dim of a full pod: only a slice that spans
        a whole dim gets that dim's wraparound links (v2/v3/v5e/v6e). Empty when
        every slice dim that is a multiple of 4 wraps (v4/v5p: the optical
        switches close each dimension of whole 4x4x4 cubes).
      source: the references of this row (see the module docstring).
    """

    name: str
    devices_per_chip: int
    hbm_bytes_per_chip: float
    hbm_bandwidth_per_chip: float
    peak_bf16_flops_per_chip: float
    ici_links_per_chip: int = 0
    ici_link_bandwidth: float = 0.0
    torus_dims: int = 0
    pod_shape: tuple[int, ...] = ()
    source: str = ""

    @property
    def hbm_bytes(self) -> float:
        """HBM capacity of one JAX device."""
        return self.hbm_bytes_per_chip / self.devices_per_chip

    @property
    def hbm_bandwidth(self) -> float:
        """HBM bytes/s of one JAX device."""
        return self.hbm_bandwidth_per_chip / self.devices_per_chip

    @property
    def peak_flops(self) -> float:
        """Peak dense bf16 FLOP/s of one JAX device."""
        return self.peak_bf16_flops_per_chip / self.devices_per_chip


_TABLE = (
    # TPU v2: 46 TFLOPS, 16 GiB (8 per core), 700 GB/s, 4 ICI links x 496 Gbit/s, 2-D
    # torus; a v2 pod is 512 chips, 16 x 32 [CACM20].
    Accelerator("v2", 2, 16 * GIB, 700 * GB, 46e12, 4, 496e9 / 8, 2, (16, 32), "CACM20"),
    # TPU v3: 123 TFLOPS, 32 GiB (16 per core), 900 GB/s, 2-D torus, 1024-chip pod
    # (32 x 32) [TPUv3]; 4 ICI links x 656 Gbit/s [CACM20].
    Accelerator("v3", 2, 32 * GIB, 900 * GB, 123e12, 4, 656e9 / 8, 2, (32, 32), "TPUv3, CACM20"),
    # TPU v4: 275 TFLOPS, 32 GiB, 1200 GB/s, 3-D torus, 1.1 PB/s all-reduce bandwidth
    # over 4096 chips x 6 links [TPUv4]. One device per chip (megacore).
    Accelerator("v4", 1, 32 * GIB, 1200 * GB, 275e12, 6, 1.1e15 / 4096 / 6, 3, (), "TPUv4"),
    # TPU v5e: 197 TFLOPS, 16 GB, 819 GB/s, 400 GB/s bidirectional ICI per chip over
    # 4 ports, 2-D torus, 256-chip pod (16 x 16) [TPUv5e].
    Accelerator("v5e", 1, 16 * GB, 819 * GB, 197e12, 4, 400 * GB / 8, 2, (16, 16), "TPUv5e"),
    # TPU v5p: 459 TFLOPS, 95 GiB, 2575 GiB/s, 1200 GB/s bidirectional ICI per chip
    # over 6 links, 3-D torus [TPUv5p]. One device per chip (megacore).
    Accelerator("v5p", 1, 95 * GIB, 2575 * GIB, 459e12, 6, 1200 * GB / 12, 3, (), "TPUv5p"),
    # TPU v6e: 918 TFLOPS, 32 GB, 1640 GB/s, 800 GB/s bidirectional ICI per chip over
    # 4 ports, 2-D torus, 256-chip pod (16 x 16) [TPUv6e].
    Accelerator("v6e", 1, 32 * GB, 1640 * GB, 918e12, 4, 800 * GB / 8, 2, (16, 16), "TPUv6e"),
    Accelerator("a100-40gb", 1, 40 * GB, 1555 * GB, 312e12, source="A100"),
    Accelerator("a100-80gb", 1, 80 * GB, 2039 * GB, 312e12, source="A100"),
    Accelerator("h100-sxm", 1, 80 * GB, 3350 * GB, 989.5e12, source="H100"),
    Accelerator("h100-pcie", 1, 80 * GB, 2000 * GB, 756.5e12, source="H100"),
    Accelerator("h200", 1, 141 * GB, 4800 * GB, 989.5e12, source="H200"),
)
ACCELERATORS = {a.name: a for a in _TABLE}

# device_kind strings as JAX reports them (TPU kinds: jax/_src/mesh_utils.py; the
# topologies of libtpu report "TPU v5" for v5p), most specific first.
_KINDS = (
    ("TPU v2", "v2"),
    ("TPU v3", "v3"),
    ("TPU v4", "v4"),
    ("TPU v5 lite", "v5e"),
    ("TPU v5e", "v5e"),
    ("TPU v5p", "v5p"),
    ("TPU v5", "v5p"),
    ("TPU v6 lite", "v6e"),
    ("TPU v6e", "v6e"),
    ("A100-SXM4-40GB", "a100-40gb"),
    ("A100-PCIE-40GB", "a100-40gb"),
    ("A100", "a100-80gb"),
    ("H100 PCIe", "h100-pcie"),
    ("H100", "h100-sxm"),
    ("H200", "h200"),
)


def lookup(device_kind: str) -> Accelerator | None:
    """The table row of a ``jax.Device.device_kind``, or None if unknown."""
    if device_kind == "TPU v4 lite":  # an inference part, not in the table
        return None
    for pattern, name in _KINDS:
        if device_kind == pattern or (not pattern.startswith("TPU") and pattern in device_kind):
            return ACCELERATORS[name]
    return None


_warned: set[str] = set()


def peak_flops_per_device(device, override: float = 0.0, cache_dir: str | None = None) -> float:
    """Peak FLOP/s of one device for MFU, or 0.0 when unknown (MFU left out).

    Args:
      device: a ``jax.Device``.
      override: ``config.peak_flops_per_device``; used as is when > 0.
      cache_dir: where a CPU's measured matmul peak is cached (see
        :func:`cpu_peak_flops`); None leaves MFU out on CPU.

    An accelerator the table does not know warns once and gives 0.0.
    """
    if override > 0:
        return float(override)
    if device.platform == "cpu":
        return cpu_peak_flops(cache_dir) if cache_dir else 0.0
    row = lookup(device.device_kind)
    if row is None:
        if device.device_kind not in _warned:
            _warned.add(device.device_kind)
            errors.warn(
                f"no peak FLOP/s known for device kind '{device.device_kind}': MFU is left "
                f"out; set config.peak_flops_per_device to report it"
            )
        return 0.0
    return row.peak_flops


def default_cache_dir() -> str:
    """``$XDG_CACHE_HOME/wus-trainer`` (``~/.cache/wus-trainer``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "wus-trainer")


def cpu_peak_flops(cache_dir: str) -> float:
    """This machine's measured f32 matmul FLOP/s per CPU device, measured once.

    The figure is cached in ``cache_dir/cpu_peak.json`` keyed by the CPU model
    and the number of devices JAX exposes (they share the cores, so the
    per-device peak depends on it); delete the file to measure again.
    """
    import jax  # noqa: PLC0415

    key = f"{_cpu_model()}|{os.cpu_count()} cores|{jax.device_count()} devices"
    path = os.path.join(cache_dir, "cpu_peak.json")
    try:
        with open(path) as f:
            cached = json.load(f)
    except (OSError, ValueError):
        cached = {}
    if key not in cached:
        cached[key] = measure_matmul_peak("float32") / jax.device_count()
        os.makedirs(cache_dir, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(cached, f, indent=2)
        os.replace(tmp, path)
    return float(cached[key])


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


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform  # noqa: PLC0415

    return platform.processor() or platform.machine()
