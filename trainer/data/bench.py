"""``python -m trainer.data.bench --config C [--workers 0,1,2] [--seconds S] [--json FILE]``.

The training input pipeline alone: examples/s per host core, per worker count.
For example, ImageNet-size JPEGs generated locally:

    python -m trainer.data.bench --config configs/resnet50_16.py:local_jpeg \\
        --workers 0,1,2 --seconds 30 --json /tmp/data_bench.json \\
        --config.global_batch_size=128

Builds only the config's training input (no model, no devices), as process 0 of
`--processes` (default 1: the whole global batch), and reports:
  * start-up: seconds and peak memory to build the pipeline (reading ratings,
    tokenizer, lengths...; generated datasets are prepared first, not counted);
  * per worker count: examples/s, host cores used (CPU time of this process and
    its workers over the wall time) and examples/s per core, peak memory (RSS) of
    the pipeline's processes;
  * for image pipelines, the time per image of each stage (read, decode, augment),
    measured one image at a time in this process.
JSON: {"startup": {...}, "workers": {"0": {"examples_per_s": ..., "per_core": ...}, ...},
"stages_ms": {...}}. Linux only (/proc).

Example:
python -m trainer.data.bench --config configs/transformer_1024.py:tiny --workers 0,1 --seconds 5
"""

import json
import os
import resource
import sys
import time
from typing import Any

import numpy as np
from absl import flags
from ml_collections import config_flags

from trainer import tasks
from trainer.command import cli, process
from trainer.input import augment, feed, imagenet, options, source

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config: path[:variant].")
_WORKERS = flags.DEFINE_list("workers", ["0", "1", "2"], "Worker counts to measure.")
_SECONDS = flags.DEFINE_float("seconds", 20.0, "Measured seconds per worker count.")
_WARMUP = flags.DEFINE_integer("warmup_batches", 2, "Batches taken before measuring.")
_PROCESSES = flags.DEFINE_integer("processes", 1, "Read the share of process 0 of this many.")
_STAGE_IMAGES = flags.DEFINE_integer("stage_images", 200, "Images timed stage by stage.")
_JSON = flags.DEFINE_string("json", None, "Also write the figures to this file.")
flags.mark_flags_as_required(["config"])

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _process_tree() -> list[int]:
    """This process and its descendants (grain workers are spawned children)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue  # Exited meanwhile.
            children.setdefault(parent, []).append(int(entry))
    tree, todo = [], [os.getpid()]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _cpu_and_rss(pids: list[int]) -> tuple[float, dict[int, int]]:
    """(CPU seconds used so far by `pids`, resident bytes of each)."""
    cpu, rss = 0.0, {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu += (int(fields[11]) + int(fields[12])) / _TICKS  # utime + stime
        rss[pid] = int(fields[21]) * _PAGE
    return cpu, rss


def measure(batches: feed.TrainBatches, workers: int, seconds: float) -> dict[str, float]:
    """Throughput of the training batches with `workers` worker processes."""
    train = batches.with_workers(workers)
    rows = 0
    try:
        for _ in range(_WARMUP.value):  # Workers start, plans and caches fill.
            next(train)
        cpu_start, _ = _cpu_and_rss(_process_tree())
        start = peak = time.perf_counter()
        peak_rss, end = 0, start + seconds
        while time.perf_counter() < end:
            batch = next(train)
            rows += len(next(iter(batch.values())))
            if time.perf_counter() - peak > 0.5:  # Sample memory twice a second.
                peak = time.perf_counter()
                peak_rss = max(peak_rss, sum(_cpu_and_rss(_process_tree())[1].values()))
        wall = time.perf_counter() - start
        cpu_end, rss = _cpu_and_rss(_process_tree())
        peak_rss = max(peak_rss, sum(rss.values()))
    finally:
        train.close()
    cores = (cpu_end - cpu_start) / wall
    return {
        "examples_per_s": rows / wall,
        "cores_used": cores,
        "per_core": rows / wall / max(cores, 1e-9),
        "seconds": wall,
        "examples": rows,
        "peak_rss_mib": peak_rss / 2**20,
        "processes": len(rss),
    }


def image_stages(config: Any, count: int) -> dict[str, float]:
    """Milliseconds per image of read, decode (at the crop's DCT scale) and augment."""
    images = imagenet.open_images(config.data.name, config.data.train_split, config.data.data_dir)
    size = config.data.image_size
    rng = np.random.default_rng(0)
    totals = {"read": 0.0, "decode": 0.0, "augment": 0.0}
    sizes = []
    for index in rng.permutation(len(images))[:count].tolist():
        t0 = time.perf_counter()
        record = images[index]
        t1 = time.perf_counter()
        opened = augment.open_image(record["image"])
        box = augment.random_crop_box(opened.size[1], opened.size[0], rng, 0.08)
        decoded, scaled = augment.decode_for_box(opened, box, size)
        t2 = time.perf_counter()
        crop = augment.resize_box(decoded, scaled, size)
        out = np.empty_like(crop)
        out[:] = crop[:, ::-1]
        t3 = time.perf_counter()
        totals["read"] += t1 - t0
        totals["decode"] += t2 - t1
        totals["augment"] += t3 - t2
        if isinstance(record["image"], bytes):
            sizes.append(len(record["image"]))
    stages = {key: 1000 * value / count for key, value in totals.items()}
    if sizes:
        stages["mean_jpeg_kb"] = float(np.mean(sizes)) / 1000
    return stages


def main(argv: list[str]) -> None:
    cli.reject_arguments(argv)
    process.setup()  # quiet libraries: TFDS logs every dataset_info it loads
    config = _CONFIG.value
    try:
        workers = [int(w) for w in _WORKERS.value]
    except ValueError:
        cli.fail(f"--workers: expected worker counts like 0,1,2, got {_WORKERS.value}")
    if min(workers, default=0) < 0 or _SECONDS.value <= 0 or _PROCESSES.value < 1:
        cli.fail(
            f"--workers {workers} must be >= 0, --seconds {_SECONDS.value} > 0 and "
            f"--processes {_PROCESSES.value} >= 1"
        )
    with cli.clear_errors():
        _bench(config, workers)


def _bench(config: Any, worker_counts: list[int]) -> None:
    """Builds the pipeline once, then measures it with each worker count."""
    config.data.data_dir = options.data_dir(config.data.data_dir)
    start = time.perf_counter()
    source.prepare_embedded(config.data.name, config.data.data_dir)
    prepare_s = time.perf_counter() - start
    # A fixed reference workload timed next to the start-up, so that start-up figures
    # from a busy (shared) machine can be scaled: sorting 20M int64 keys, one core.
    keys = np.random.default_rng(0).integers(0, 2**40, 20_000_000)
    start, cpu_start = time.perf_counter(), time.process_time()
    np.sort(keys)
    reference = {"s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start}
    del keys
    # Start-up: build the pipeline once in this process (no workers yet).
    config.data.worker_count = 0
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start, cpu_start = time.perf_counter(), time.process_time()
    data = tasks.open_data(config, 0, _PROCESSES.value)
    startup = {
        "generate_s": prepare_s,
        "build_s": time.perf_counter() - start,
        # CPU seconds: the wall time on a quiet machine (start-up runs on one thread).
        "build_cpu_s": time.process_time() - cpu_start,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "peak_rss_before_mib": rss_before / 1024,
        "reference_sort_20m": reference,
    }
    result: dict[str, Any] = {"startup": startup, "workers": {}}
    print(
        f"start-up: dataset ready in {startup['generate_s']:.2f}s, pipeline built in "
        f"{startup['build_s']:.2f}s ({startup['build_cpu_s']:.2f} CPU s), peak RSS "
        f"{startup['peak_rss_mib']:.0f} MiB; a reference sort of 20M keys took "
        f"{reference['s']:.2f}s here (scales start-up figures from a busy machine)",
        flush=True,
    )
    if config.model.name == "resnet":
        result["stages_ms"] = image_stages(config, _STAGE_IMAGES.value)
        stages = ", ".join(f"{k} {v:.3g}" for k, v in result["stages_ms"].items())
        print(f"stages (ms per image): {stages}", flush=True)
    for workers in worker_counts:
        figures = measure(data.train, workers, _SECONDS.value)
        result["workers"][str(workers)] = figures
        print(
            f"workers={workers}: {figures['examples_per_s']:.1f} examples/s, "
            f"{figures['cores_used']:.2f} cores, {figures['per_core']:.1f} per core, "
            f"peak RSS {figures['peak_rss_mib']:.0f} MiB in {figures['processes']} processes",
            flush=True,
        )
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(result, f, indent=2)
    sys.stdout.flush()


if __name__ == "__main__":
    process.run(main)
