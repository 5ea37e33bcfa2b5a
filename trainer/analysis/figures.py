"""The figures of runs and benchmarks: ``python -m trainer.plot`` and ``trainer.bench
--plot``. Needs matplotlib (``pip install -e '.[plot]'``).

:func:`plot_runs` overlays the runs in some directories: training loss and every
eval metric against steps (``metrics.jsonl``; evaluations made later by
``trainer.evaluate``, from ``eval.jsonl``, as open markers). A step logged twice
(a run resumed from an earlier checkpoint logs the steps after it again) is drawn
with its last value. :func:`plot_bench` draws the benchmark's modes side by side.
"""

from __future__ import annotations

import math
import os

from trainer import console
from trainer.errors import UserError
from trainer.workdir import rows as rows_lib
from trainer.workdir import storage

Series = dict[str, list[tuple[int, float]]]  # metric -> [(step, value)], by step


def read_series(workdir: str, filename: str = "metrics.jsonl", *, last: bool = True) -> Series:
    """``{metric: [(step, value), ...]}`` from one of a run's JSON-lines files.

    Lines no tool can read (cut short, not UTF-8, without an integer step) are
    skipped, with one warning (:mod:`trainer.workdir.rows`).

    Args:
      workdir: the run directory.
      filename: ``metrics.jsonl`` or ``eval.jsonl`` (a missing file reads as {}).
      last: keep only the last value logged for a step (else every one, e.g.
        evaluations of one checkpoint with several beam sizes).
    """
    path = storage.path(workdir) / filename
    rows, skipped = rows_lib.read(path)
    if skipped:
        console.warn(rows_lib.skipped_warning(path, skipped))
    series: dict[str, list[tuple[int, float]]] = {}
    for row in rows:
        for key, value in row.items():
            if key == "step" or isinstance(value, bool):
                continue
            if isinstance(value, int | float) and math.isfinite(value):
                series.setdefault(key, []).append((row["step"], float(value)))
    if last:
        return {k: sorted(dict(points).items()) for k, points in series.items()}
    return {k: sorted(points) for k, points in series.items()}


def run_names(workdirs: list[str]) -> list[str]:
    """Short distinct names: the last path component, or more of it where two agree."""
    parts = [os.fspath(w).rstrip("/").split("/") for w in workdirs]
    for depth in range(1, max(len(p) for p in parts) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [os.fspath(w) for w in workdirs]


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415  (an optional extra)
    except ImportError:
        raise UserError("plotting needs matplotlib: pip install -e '.[plot]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt


def plot_runs(workdirs: list[str], out: str, names: list[str] | None = None) -> list[str]:
    """Writes the runs' figure to ``out``; returns the metrics drawn (panel titles)."""
    plt = _pyplot()
    names = names or run_names(workdirs)
    runs = [(read_series(w), read_series(w, "eval.jsonl", last=False)) for w in workdirs]
    empty = [w for w, (train, later) in zip(workdirs, runs, strict=True) if not train and not later]
    if len(empty) == len(workdirs):
        raise UserError(
            f"nothing to plot: no step of {', '.join(map(str, empty))} has been logged yet (a "
            "run logs every log_every_steps; one stopped before its first log step has none)"
        )
    for w in empty:
        console.warn(f"{w} has no logged step yet: left out of the figure")
    kept = [i for i, w in enumerate(workdirs) if w not in empty]
    names, runs = [names[i] for i in kept], [runs[i] for i in kept]
    metrics = ["loss"] + sorted(
        {k for train, later in runs for k in (*train, *later) if k.startswith("eval/")}
    )
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, metrics, strict=False):
        for i, (name, (train, later)) in enumerate(zip(names, runs, strict=True)):
            color = colors[i % len(colors)]
            if metric in train:
                steps, values = zip(*train[metric], strict=True)
                marker = "o" if len(steps) < 12 else None
                ax.plot(steps, values, color=color, marker=marker, markersize=3, label=name)
            if metric in later:
                steps, values = zip(*later[metric], strict=True)
                ax.plot(
                    steps,
                    values,
                    linestyle="none",
                    marker="o",
                    markerfacecolor="none",
                    color=color,
                    label=f"{name} (trainer.evaluate)",
                )
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if metric == "loss":
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(metrics) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    for ax in list(axes.flat)[1 : len(metrics)]:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.02 * (len(labels) // 4), 1, 1))
    _save(fig, out)
    plt.close(fig)
    return metrics


def _save(fig, out: str) -> None:
    path = storage.path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as f:
        fig.savefig(f, format="png", dpi=90)


def plot_bench(results: dict, out: str) -> None:
    """The benchmark's figure: per update-sharding mode, the median step time,
    per-device state and temp bytes, and collective bytes per step by kind.

    Args:
      results: ``{mode: figures}`` as ``trainer.bench`` returns (and writes with --json).
      out: the PNG file.
    """
    plt = _pyplot()
    modes = list(results)
    mib = 2.0**20
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    x = range(len(modes))

    ax = axes[0]
    ax.bar(x, [results[m]["step_time_s"] * 1e3 for m in modes], color="tab:blue")
    ax.set_title("step time (median, ms)")

    ax = axes[1]
    width = 0.38
    state = [results[m]["state_bytes_per_device"] / mib for m in modes]
    temp = [results[m]["temp_bytes"] / mib for m in modes]
    ax.bar([i - width / 2 for i in x], state, width, label="weights + optimizer state")
    ax.bar([i + width / 2 for i in x], temp, width, label="temporaries")
    ax.set_title("per-device MiB")
    ax.legend(fontsize=8)

    ax = axes[2]
    kinds = sorted({k for m in modes for k in results[m]["collective_bytes"]})
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        values = [results[m]["collective_bytes"].get(kind, 0) / mib for m in modes]
        ax.bar([i - 0.4 + width * (j + 0.5) for i in x], values, width, label=kind)
    ax.set_title("collective MiB per step per device")
    if kinds:
        ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xticks(list(x), modes)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, out)
    plt.close(fig)
