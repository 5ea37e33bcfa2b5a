"""Where a traced run's device time goes: the compiled ops' times of a profile
(``--config.profile_steps``), summed by op and by kind.

    python -m trainer ... --config.profile_steps=2,2 --workdir W
    python scripts/op_times.py W --steps 2 --devices 8

Reads the Perfetto trace the run wrote (``W/profile/**/*.trace.json.gz``, plain JSON),
or any JAX profile's ``*.xplane.pb`` (read with ``jax.profiler.ProfileData``: MaxText's
``profiler=xplane`` writes only that, so both frameworks' runs are read alike):
one complete event per executed op on XLA's threads (``tf_XLA...``; XLA:CPU names
each by its HLO instruction: ``ynn_fusion.31``, ``all_gather.90``). Other threads'
events (the host's Python), the runtime's own (``ThunkExecutor::Execute``,
``Rendezvous``, waits) and loops' are left out: they enclose or overlap the ops, or
are not the program's. The times are summed over the threads that ran them and
divided by the run's device count (``--devices``) and ``--steps``: milliseconds a
device spends in each op a step. On simulated CPU devices that share a few cores, an
op's time includes its wait for a core, so compare kinds within one trace or between
traces of one load.

Kinds, by the instruction's name: matmuls (XLA:CPU's YNNPACK fusions, dots,
convolutions), collectives (the opcodes of ``trainer.analysis.hlo.KINDS``, which
XLA:CPU's instruction names spell with ``_`` or ``-``), copies and slices (copies, transposes,
dynamic-update-slices, dynamic-slices), and the other fusions.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from jax.profiler import ProfileData  # noqa: E402

from trainer.analysis import hlo  # noqa: E402

# Events of the runtime and the Python tracer, and control flow (a loop's event
# spans its body's ops): not ops of their own, they enclose or overlap them.
_RUNTIME = ("ThunkExecutor", "Wait", "Rendezvous", "$", "while", "conditional", "call")
_COLLECTIVES = tuple(k.replace("-", "_") for k in hlo.KINDS)
_COPIES = ("copy", "transpose", "dynamic_update_slice", "dynamic_slice")


def kind(name: str) -> str | None:
    """The kind of op an event name is (module doc), or None for a runtime event."""
    if name.startswith(_RUNTIME):
        return None
    low = name.lower().replace("-", "_")
    if low.startswith("ynn") or "dot" in low or "convolution" in low:
        return "matmuls"
    if any(k in low for k in _COLLECTIVES):
        return "collectives"
    if any(k in low for k in _COPIES):
        return "copies and slices"
    return "other fusions"


def find_trace(path: str) -> str:
    """``path`` if it is a trace, else the newest trace under it (Perfetto's JSON
    first, then an ``.xplane.pb``)."""
    if os.path.isfile(path):
        return path
    for pattern in ("*.trace.json.gz", "*.xplane.pb"):
        traces = glob.glob(os.path.join(path, "**", pattern), recursive=True)
        if traces:
            return max(traces, key=os.path.getmtime)
    raise SystemExit(f"error: no *.trace.json.gz or *.xplane.pb under {path} (profile_steps?)")


def _json_events(trace: str):
    """``(name, microseconds)`` of the complete events on XLA's threads of a Perfetto trace."""
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    xla = {  # XLA's threads, which run the ops
        (e["pid"], e["tid"])
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "thread_name"
        and e["args"]["name"].startswith("tf_XLA")
    }
    for event in events:
        if event.get("ph") == "X" and (event.get("pid"), event.get("tid")) in xla:
            yield event["name"], event.get("dur", 0)


def _xplane_events(trace: str):
    """``(name, microseconds)`` of the events on XLA's threads (the host plane's lines
    named ``tf_XLA...``) of an XSpace."""
    host = ProfileData.from_file(trace).find_plane_with_name("/host:CPU")
    for line in host.lines if host else ():
        if line.name.startswith("tf_XLA"):
            for event in line.events:
                yield event.name, event.duration_ns / 1e3


def op_times(trace: str) -> tuple[dict[str, float], dict[str, int]]:
    """``(microseconds by op name, events by op name)`` of a trace's ops."""
    events = _xplane_events(trace) if trace.endswith(".xplane.pb") else _json_events(trace)
    times: dict[str, float] = collections.Counter()
    counts: dict[str, int] = collections.Counter()
    for name, us in events:
        if kind(name) is None:
            continue
        times[name] += us
        counts[name] += 1
    return times, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a run's workdir, or a .trace.json.gz")
    parser.add_argument("--steps", type=int, default=1, help="steps the trace holds")
    parser.add_argument("--devices", type=int, required=True, help="the run's devices")
    parser.add_argument("--top", type=int, default=15, help="ops to list")
    args = parser.parse_args()
    trace = find_trace(args.path)
    times, counts = op_times(trace)
    scale = 1e-3 / args.devices / args.steps  # microseconds summed -> ms a device a step
    by_kind: dict[str, float] = collections.Counter()
    for name, us in times.items():
        by_kind[kind(name)] += us
    print(f"{trace}: {args.devices} devices, {args.steps} steps; ms a device a step")
    for k, us in by_kind.most_common():
        print(f"  {k:18s} {us * scale:9.1f}")
    print(f"  {'all ops':18s} {sum(times.values()) * scale:9.1f}")
    print(f"the {args.top} longest ops (runs a device a step):")
    for name, us in collections.Counter(times).most_common(args.top):
        runs = counts[name] / args.devices / args.steps
        print(f"  {us * scale:9.1f}  {runs:5.1f}  {kind(name):18s} {name}")


if __name__ == "__main__":
    main()
