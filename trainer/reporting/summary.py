"""A run's closing summary: where the time went, how fast it trained, how good it
got, and what it wrote; printed, and kept as ``DIR/summary.json``."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import time
from collections.abc import Iterator

from etils import epath

from trainer import console
from trainer.workdir import lock, storage
from trainer.workdir import rows as rows_lib

# The phases of a run's wall time; "start-up" is what the others leave (imports,
# the devices, data and model set-up, the checkpoint read).
PHASES = ("compile", "train", "eval", "save")
# What the summary's hint installs; the version the project tests its events with
# (pyproject.toml's test extra).
TENSORBOARD = "tensorboard==2.21.0"
# Eval metrics where lower is better; every other eval metric (BLEU, accuracy,
# HR@10, NDCG@10) is better higher.
_LOWER_IS_BETTER = ("loss", "nll", "perplexity", "error")


def _lower_is_better(metric: str) -> bool:
    return any(word in metric for word in _LOWER_IS_BETTER)


class RunReport:
    """Times the phases of one run and, at its end, says and writes the summary.

    Args:
      directory: the run's work directory.
      started: ``time.time()`` when the process started (the command's first line).
    """

    def __init__(self, directory: epath.Path, *, started: float | None = None):
        self.directory = directory
        self.started = time.time() if started is None else started
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._ended_now = False  # a way out that leaves at once wrote the last word

    @contextlib.contextmanager
    def timing(self, phase: str) -> Iterator[None]:
        """Adds the wall time of the block to ``phase`` (one of :data:`PHASES`)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        """Adds ``seconds`` to ``phase``."""
        self.seconds[phase] += seconds

    def begin(self) -> None:
        """Marks ``summary.json`` as that of a run in progress (process 0, once the run
        holds the work directory): until this run rewrites it at its end, it never
        describes an earlier run, also when this one is killed or fails."""
        self._write(
            {
                "status": "running",
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
                "pid": os.getpid(),
                "host": socket.gethostname(),
            }
        )

    def failed(self, error: BaseException) -> None:
        """Records in ``summary.json`` that the run ended with ``error`` (process 0)."""
        with contextlib.suppress(OSError):  # a full disk may be why it failed
            self._write(
                {
                    "status": "failed",
                    "error": " ".join(str(error).split()) or type(error).__name__,
                    "first_step": self.first_step,
                    "last_step": self.last_step,
                }
            )

    def ended_now(self, why: str, *, failed: bool, lead: bool) -> None:
        """Records a run that leaves at once, from another thread: ``stopped (why)``
        (Ctrl-C twice; process 0 writes it) or ``failed`` with ``why`` (a lost peer:
        whichever process found it writes it, process 0 may be the one lost)."""
        self._ended_now = True
        if not (failed or lead):
            return
        if not lead and _status(self.directory) != "running":
            return  # process 0 already said how the run ended
        summary = {"first_step": self.first_step, "last_step": self.last_step}
        if failed:
            summary = {"status": "failed", "error": " ".join(why.split()), **summary}
        else:
            summary = {"status": f"stopped ({why})", **summary}
        with contextlib.suppress(OSError):
            self._write(summary, last_word=True)

    def _write(self, summary: dict, *, last_word: bool = False) -> None:
        if self._ended_now and not last_word:
            return
        storage.write_atomically(
            self.directory / "summary.json", json.dumps(summary, indent=2) + "\n"
        )

    def summary(
        self,
        *,
        global_batch_size: int,
        newest_checkpoint: str | None,
        commands: list[str],
        stopped_by: str | None = None,
    ) -> dict:
        """The summary as a dict (what ``summary.json`` holds); ``stopped_by`` names the
        signal that stopped the run early (None: it ran to its last step)."""
        wall = time.time() - self.started
        steps = (self.last_step or 0) - (self.first_step or 0)
        train_s = self.seconds["train"]
        rows = _metric_rows(self.directory)
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        # The last evaluation's metrics only: its row also holds that loop's training
        # loss, which is not an eval metric.
        final = None
        if evals:
            final = {"step": evals[-1]["step"]}
            final |= {k: v for k, v in evals[-1].items() if k.startswith("eval/")}
        best = {}
        for key in sorted({k for r in evals for k in r if k.startswith("eval/")}):
            pick = min if _lower_is_better(key) else max
            row = pick((r for r in evals if key in r), key=lambda r, key=key: r[key])
            best[key] = {"value": row[key], "step": row["step"]}
        return {
            "status": f"stopped ({stopped_by})" if stopped_by else "finished",
            "first_step": self.first_step,
            "last_step": self.last_step,
            "steps_trained": steps,
            "wall_time_s": {
                "total": wall,
                "start-up": max(wall - sum(self.seconds.values()), 0.0),
                **self.seconds,
            },
            "steps_per_sec": steps / train_s if train_s else None,
            "examples_per_sec": steps * global_batch_size / train_s if train_s else None,
            "final_eval": final,
            "best_eval": best,
            "newest_checkpoint": newest_checkpoint,
            "files": user_files(self.directory),
            "commands": commands,
        }

    def finish(self, **kwargs) -> dict:
        """Writes ``summary.json``, says the summary (:func:`render`) and returns it;
        call on process 0 only. Arguments as :meth:`summary`."""
        out = self.summary(**kwargs)
        self._write(out)
        console.say(render(out, self.directory))
        return out


def _status(directory: epath.Path) -> str | None:
    """The ``status`` of ``directory/summary.json`` (None: none can be read)."""
    try:
        return json.loads((directory / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        return None


def user_files(directory: epath.Path) -> list[str]:
    """What a user will open in ``directory``: its files but the run's locks (removed at
    a clean exit, :mod:`trainer.workdir.lock`) and hidden ones."""
    internal = {lock.FILE, lock.PEERS_FILE}
    names = {p.name for p in directory.iterdir()} | {"summary.json"}
    return sorted(n for n in names if n not in internal and not n.startswith("."))


def render(summary: dict, directory: epath.Path) -> str:
    """The summary as the console shows it."""
    wall = summary["wall_time_s"]
    split = ", ".join(f"{phase} {console.duration(wall[phase])}" for phase in ("start-up", *PHASES))
    lines = [
        f"summary: steps {summary['first_step']} -> {summary['last_step']} in "
        f"{console.duration(wall['total'])} ({split})"
    ]
    if summary["steps_per_sec"]:
        lines.append(
            f"  speed: {summary['steps_per_sec']:.3g} steps/s, "
            f"{summary['examples_per_sec']:,.0f} examples/s (while training)"
        )
    if final := summary["final_eval"]:
        metrics = ", ".join(f"{k} {v:.4g}" for k, v in final.items() if k.startswith("eval/"))
        lines.append(f"  final eval (step {final['step']}): {metrics}")
    if best := summary["best_eval"]:
        lines.append(
            "  best eval: "
            + ", ".join(f"{k} {b['value']:.4g} (step {b['step']})" for k, b in best.items())
        )
    lines.append(f"  newest checkpoint: {summary['newest_checkpoint'] or 'none'}")
    lines.append(f"  files in {directory}: {', '.join(summary['files'])}")
    lines += ["  look at it with:", *(f"    {c}" for c in summary["commands"])]
    return "\n".join(lines)


def _metric_rows(directory: epath.Path) -> list[dict]:
    """The usable rows of ``metrics.jsonl`` (every step this run directory logged, also
    before a resume; :mod:`trainer.workdir.rows`)."""
    return rows_lib.read(directory / "metrics.jsonl")[0]


def commands(directory: epath.Path, *, evaluate_flags: str = "") -> list[str]:
    """The commands that show a finished run of ``directory``; ``evaluate_flags`` are
    what ``trainer.evaluate`` needs to see the run's devices (``--cpu_devices 8``)."""
    where = str(directory)
    out = [f"tensorboard --logdir {where}"]
    if importlib.util.find_spec("tensorboard") is None:
        # Not a dependency: 54 MB in five packages, a binary data server among them, for
        # a viewer; the trainer writes its event files without it (tensorboardX).
        out[0] += f"   (not installed: pip install {TENSORBOARD})"
    if _metric_rows(directory):  # a run stopped before its first log step has none
        out.append(f"python -m trainer.plot {where} --out {where}/metrics.png")
        if importlib.util.find_spec("matplotlib") is None:
            out[-1] += "   (needs matplotlib: pip install -e '.[plot]')"
    out.append(f"python -m trainer.evaluate --workdir {where}{evaluate_flags}")
    return out
